"""The receiving side of every transport: stage buckets, verify them, apply only a whole refit.

`Staging` holds one flat byte tensor laid out like the sender's `Layout`. Each bucket is checked
against the refit info (names, shapes, dtypes, offsets; every name at most once), copied in with
one copy and, when the sender sent a checksum, verified on the staged bytes. Only `commit` —
after every name arrived — writes the receiver's live tensors, so a refit that fails at any point
leaves them as they were (at the previous version).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from policyworker.refit.layout import Layout, RefitError, RefitInfo, check_targets, checksum


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Staging:
    """A receiver's staging area for `info`, applied to `targets` ({hf_name: tensor})."""

    def __init__(self, info: RefitInfo, targets: Mapping[str, torch.Tensor]) -> None:
        check_targets(info, targets)
        self.layout = Layout(info, bucket_bytes=None)
        self.targets = dict(targets)
        self.device = next(iter(targets.values())).device if targets else torch.device("cpu")
        self.flat: torch.Tensor | None = None  # allocated at the first refit, then reused
        self.version: int | None = None
        """Version of the live weights (None before the first refit)."""
        self._seen: set[str] = set()
        self._incoming: int | None = None

    def begin(self, version: int) -> None:
        if self.flat is None:
            self.flat = torch.empty(self.layout.total, dtype=torch.uint8, device=self.device)
        self._seen.clear()
        self._incoming = version

    def stage(self, header: Mapping[str, Any], data: torch.Tensor) -> None:
        """Check one bucket's header against the refit info, copy its bytes, verify them."""
        assert self.flat is not None
        self._check_version(header["version"])
        start, end = header["start"], header["end"]
        for name, shape, dtype, offset, _ in header["slots"]:
            slot = self.layout.slots.get(name)
            sent = (tuple(shape), dtype, offset)
            if slot is None:
                raise RefitError(f"refit info: {name} is not a tensor of this receiver")
            if sent != (slot.shape, dtype_name(slot.dtype), slot.offset):
                raise RefitError(
                    f"refit info: {name} sent as {sent[:2]} at byte {offset}, expected "
                    f"{(slot.shape, dtype_name(slot.dtype))} at byte {slot.offset}"
                )
            if name in self._seen:
                raise RefitError(f"refit: {name} arrived twice")
            if not (start <= offset and offset + slot.nbytes <= end):
                raise RefitError(f"refit: {name} lies outside its bucket [{start}, {end})")
        if end > self.layout.total or end - start > data.numel():
            raise RefitError(f"refit: bucket [{start}, {end}) exceeds the layout or its buffer")
        staged = self.flat[start:end]
        staged.copy_(data[: end - start])
        if staged.is_cuda:  # the ack lets the sender reuse the buffer: the copy must be done
            torch.cuda.current_stream(staged.device).synchronize()
        if header["checksum"] is not None and checksum(staged) != header["checksum"]:
            raise RefitError(
                f"refit: bucket {header['index']} failed its checksum (bytes [{start}, {end}))"
            )
        self._seen.update(name for name, *_ in header["slots"])

    def commit(self, version: int) -> None:
        """Apply the staged refit to the live tensors, once every name has arrived."""
        assert self.flat is not None
        self._check_version(version)
        missing = [n for n in self.layout.slots if n not in self._seen]
        if missing:
            raise RefitError(f"refit: {len(missing)} tensor(s) never arrived, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, slot in self.layout.slots.items():
                self.targets[name].copy_(slot.view(self.flat))
        self.version = version
        self._incoming = None

    def _check_version(self, version: int) -> None:
        if version != self._incoming:
            raise RefitError(f"refit: version {version} inside a refit of {self._incoming}")
