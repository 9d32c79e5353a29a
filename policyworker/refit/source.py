"""The trainer's side of refit: refit info, the weight version, and the transports' entry points."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from policyworker.config import RefitConfig
from policyworker.model.hf_config import ModelShape
from policyworker.parallel.dims import Groups
from policyworker.refit.export import model_tensors, owners, refit_info
from policyworker.refit.ipc import RefitReport, send_ipc
from policyworker.refit.layout import Layout, RefitInfo

MiB = 1 << 20


class RefitSource:
    """One rank's refit state: what it sends, to where, and the version of the last refit."""

    def __init__(
        self,
        params: Callable[[], dict[str, torch.Tensor]],
        shape: ModelShape,
        groups: Groups,
        device: torch.device,
        cfg: RefitConfig,
    ) -> None:
        self._params, self.shape, self.groups, self.device, self.cfg = (
            params,
            shape,
            groups,
            device,
            cfg,
        )
        self.version = 0
        """Version of the weights last refitted (0: none yet); each refit sends version + 1."""
        self._info: RefitInfo | None = None
        self._owners: list[int] = []
        sock = f"policyworker-refit-{os.getpid()}-{dist.get_rank()}.sock"
        self.address = f"ipc://{os.path.join(tempfile.gettempdir(), sock)}"
        """Where this rank's colocated receiver connects (ZMQ IPC endpoint)."""

    def info(self) -> RefitInfo:
        """Refit info of the whole model (collective over the pipeline group the first time)."""
        if self._info is None:
            params = self._params()
            self._info = refit_info(params, self.shape, self.groups)
            self._owners = owners(params, self.shape, self.groups)
        return self._info

    def stream_ipc(
        self, *, buffer_size_bytes: int, timeout_s: float | None, send: bool
    ) -> RefitReport | None:
        """Stream every weight to the receiver at `self.address` (if `send`; the other ranks
        only take part in the TP/PP gathers). Collective over the model-parallel group."""
        info = self.info()
        size = buffer_size_bytes or self.cfg.buffer_size_bytes or self._default_buffer_bytes()
        if size < 512:
            raise ValueError(f"buffer_size_bytes: expected 0 or >= 512, got {size}")
        layout = Layout(info, size)
        tensors = model_tensors(
            self._params(), self.shape, self.groups, info, self._owners, self.device
        )
        if not send:
            for _ in tensors:
                pass
            return None
        report = send_ipc(
            tensors,
            layout,
            address=self.address,
            version=self.version + 1,
            timeout_s=timeout_s or self.cfg.timeout_s,
            use_checksum=self.cfg.checksum,
            device=self.device,
        )
        self.version = report.version
        return report

    def _default_buffer_bytes(self) -> int:
        if self.device.type != "cuda":
            return 64 * MiB
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(min(max(free // 10, 64 * MiB), 2048 * MiB)) // 512 * 512
