"""What every refit transport sends (`RefitWeights`): the refit info, the tensors in its order, the
size of a bucket and the version of the last refit — one object, shared by the transports'
sources (`refit/sources.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from policyworker.config import RefitConfig, finite
from policyworker.model.hf_config import ModelShape
from policyworker.model.weights import export_hf_weights
from policyworker.parallel.dims import Groups
from policyworker.refit.export import model_tensors, owners, refit_info
from policyworker.refit.layout import RefitInfo
from policyworker.refit.prequantize import check_prequantize, prequantized, prequantized_info

MiB = 1 << 20


def check_refit_args(buffer_size_bytes: int, timeout_s: float | None, num_buffers: int = 2) -> None:
    """A refit call's arguments, refused before anything moves (`buffer_size_bytes` 0: auto).
    The one place they are checked: every source's entry points call it first."""
    size = buffer_size_bytes
    if not isinstance(size, int) or not (size == 0 or size >= 512):
        raise ValueError(f"buffer_size_bytes: expected 0 (auto) or an int >= 512, got {size!r}")
    if timeout_s is not None and not (finite(timeout_s) and timeout_s > 0):
        raise ValueError(f"refit_timeout_s: expected a finite number > 0, got {timeout_s!r}")
    if not isinstance(num_buffers, int) or num_buffers < 1:
        raise ValueError(f"num_buffers: expected an int >= 1, got {num_buffers!r}")


class RefitWeights:
    """One rank's weights as a refit sends them."""

    def __init__(
        self,
        params: Callable[[], dict[str, torch.Tensor]],
        shape: ModelShape,
        groups: Groups,
        device: torch.device,
        cfg: RefitConfig,
    ) -> None:
        self.params, self.shape, self.groups = params, shape, groups
        self.device, self.cfg = device, cfg
        self.version = 0
        """Version of the weights last refitted (0: none yet); each refit sends version + 1."""
        self.mxfp8: frozenset[str] = frozenset()
        """The names sent as MXFP8 (`enable_refit_prequantize`)."""
        self._base: RefitInfo | None = None  # the bf16 refit info
        self._info: RefitInfo | None = None  # what is sent (MXFP8 slots when prequantizing)
        self._owners: list[int] = []

    def info(self) -> RefitInfo:
        """`{hf_name: (shape, dtype)}` in refit order (collective over PP, made once)."""
        if self._info is None:
            base = self._base_info()
            self._info = prequantized_info(base, self.mxfp8) if self.mxfp8 else base
        return self._info

    def prequantize(self, names: object) -> RefitInfo:
        """Send `names` as MXFP8 from now on; the refit info that says so."""
        self.mxfp8 = check_prequantize(names, self._base_info())
        self._info = None
        return self.info()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a refit sends, in `info()` order (collective over TP and PP)."""
        base = self._base_info()
        stream = model_tensors(
            self.params(), self.shape, self.groups, base, self._owners, self.device
        )
        return prequantized(stream, self.mxfp8) if self.mxfp8 else stream

    def gather_only(self) -> None:
        """Take part in a refit's TP/PP gathers without sending (a rank that does not send)."""
        for _ in self.tensors():
            pass

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) of this pipeline stage, TP shards gathered (collective over TP)."""
        return export_hf_weights(self.params(), self.shape, self.groups)

    def bucket_bytes(self, requested: int | None) -> int:
        """A call's size, else the config's, else a tenth of free device memory (64 MiB-2 GiB;
        64 MiB on CPU)."""
        if requested or self.cfg.buffer_size_bytes:
            return requested or self.cfg.buffer_size_bytes
        if self.device.type != "cuda":
            return 64 * MiB
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(min(max(free // 10, 64 * MiB), 2048 * MiB)) // 512 * 512

    def timeout(self, requested: float | None) -> float:
        return requested or self.cfg.timeout_s

    def _base_info(self) -> RefitInfo:
        if self._base is None:
            params = self.params()
            self._base = refit_info(params, self.shape, self.groups)
            self._owners = owners(params, self.shape, self.groups)
        return self._base
