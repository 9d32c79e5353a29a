"""The receiving side of every transport: stage buckets, verify them, apply only a whole refit.

`Staging` holds one flat byte tensor laid out like the sender's `Layout`. Each bucket is checked
against the refit info (names, shapes, dtypes, offsets; every name at most once), copied in with
one copy (`stage`) or written there by the sender itself (`verify_in_place`: a shared staging
area, see docs/refit.md) and, when the sender sent a checksum, verified on the staged bytes. Only
`commit` — after every name arrived — writes the receiver's live tensors, so a refit that fails
at any point leaves them as they were (at the previous version).

`commit` either copies the staged bytes into the live tensors (`adopt=False`: their storage
stays where it is, as an engine that captured their addresses in CUDA graphs needs) or adopts
them (`adopt=True`): each live tensor becomes a view of the staged bytes (`.data` replaced, no
copy) and the bytes it held become the next refit's staging. Adopting saves a pass over the whole
model at the end of every refit, for the same memory (live weights plus one staging copy). A
target that is a view into a larger tensor (one expert's rows of transformers' fused experts) is
always copied into: replacing its `.data` would detach it from the tensor it is part of.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.refit.buffers import SharedBuffer
from policyworker.refit.layout import (
    Layout,
    RefitError,
    RefitInfo,
    SlotHeader,
    check_targets,
    checksum,
    dtype_name,
)


class Staging:
    """A receiver's staging area for `info`, applied to `targets` ({hf_name: tensor}).

    `shared=True`: the staging bytes live in a buffer another process can map (`share()`), so
    that a colocated sender writes them directly instead of through its own buffers.
    """

    def __init__(
        self,
        info: RefitInfo,
        targets: Mapping[str, torch.Tensor],
        *,
        adopt: bool = False,
        shared: bool = False,
    ) -> None:
        check_targets(info, targets)
        self.adopt, self.shared = adopt, shared
        self.layout = Layout(info, bucket_bytes=None)
        self.targets = dict(targets)
        self._adopted = {n for n, t in targets.items() if adopt and not t._is_view()}
        self.device = next(iter(targets.values())).device if targets else torch.device("cpu")
        # Staging bytes, allocated at the first refit and reused; with `adopt`, the bytes the
        # live tensors view are kept too (they are the staging of the refit after next).
        self._flat: SharedBuffer | torch.Tensor | None = None
        self._live: SharedBuffer | torch.Tensor | None = None
        self.version: int | None = None
        """Version of the live weights (None before the first refit)."""
        self._seen: set[str] = set()
        self._incoming: int | None = None
        self._expected = {  # what each slot header must say, precomputed (checked every refit)
            n: (s.shape, dtype_name(s.dtype), s.offset) for n, s in self.layout.slots.items()
        }
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # per staging flat, for commit

    @property
    def flat(self) -> torch.Tensor:
        assert self._flat is not None, "begin() first"
        return self._flat.tensor if isinstance(self._flat, SharedBuffer) else self._flat

    def begin(self, version: int, slots: Sequence[SlotHeader] | None = None) -> None:
        """Start refit `version`; `slots` (the sender's whole list, when it sends one up front)
        must be exactly this receiver's tensors."""
        if slots is not None:
            self._check_all(slots)
        if self._flat is None:
            total = self.layout.total
            self._flat = (
                SharedBuffer(total, self.device)
                if self.shared
                else torch.empty(total, dtype=torch.uint8, device=self.device)
            )
        self._seen.clear()
        self._incoming = version

    def share(self) -> dict[str, Any] | None:
        """A handle on the staging bytes for the sender to map (None unless `shared`)."""
        if not isinstance(self._flat, SharedBuffer):
            return None
        if self.device.type == "cuda":  # nothing of ours may still touch the bytes it writes
            torch.cuda.current_stream(self.device).synchronize()
        return self._flat.share()

    def stage(self, header: Mapping[str, Any], data: torch.Tensor) -> None:
        """Check one bucket's header against the refit info, copy its bytes, verify them."""
        start, end = self._check_bucket(header)
        if end - start > data.numel():
            raise RefitError(f"refit: bucket [{start}, {end}) exceeds its buffer")
        staged = self.flat[start:end]
        staged.copy_(data[: end - start])
        if staged.is_cuda:  # the ack lets the sender reuse the buffer: the copy must be done
            torch.cuda.current_stream(staged.device).synchronize()
        self._verify(header, staged)

    def verify_in_place(self, header: Mapping[str, Any]) -> None:
        """Check one bucket that the sender wrote into the shared staging bytes itself."""
        start, end = self._check_bucket(header)
        self._verify(header, self.flat[start:end])

    def commit(self, version: int) -> None:
        """Apply the staged refit to the live tensors, once every name has arrived."""
        self._check_version(version)
        missing = [n for n in self.layout.slots if n not in self._seen]
        if missing:
            raise RefitError(f"refit: {len(missing)} tensor(s) never arrived, e.g. {missing[:3]}")
        views = self._slot_views()
        with torch.no_grad():
            for name, view in views.items():
                if name in self._adopted:
                    self.targets[name].data = view
                else:
                    self.targets[name].copy_(view)
        if self.adopt:  # the bytes no longer live are staged into next (None: allocate)
            self._live, self._flat = self._flat, self._live
        self.version = version
        self._incoming = None

    def _slot_views(self) -> dict[str, torch.Tensor]:
        """Every tensor inside the current staging flat (made once per flat: a commit then
        costs no slicing)."""
        flat = self.flat
        key = flat.untyped_storage().data_ptr()
        if key not in self._views:
            self._views[key] = {n: s.view(flat) for n, s in self.layout.slots.items()}
        return self._views[key]

    def _check_all(self, slots: Sequence[SlotHeader]) -> None:
        names = {s[0] for s in slots}
        missing = [n for n in self.layout.slots if n not in names]
        if missing:
            raise RefitError(f"refit info: the sender does not send {missing[:3]}")
        for slot in slots:
            self._check_slot(slot)

    def _check_slot(self, sent: SlotHeader) -> None:
        name, shape, dtype, offset, _ = sent
        expected = self._expected.get(name)
        if expected is None:
            raise RefitError(f"refit info: {name} is not a tensor of this receiver")
        if (tuple(shape), dtype, offset) != expected:
            raise RefitError(
                f"refit info: {name} sent as {(tuple(shape), dtype)} at byte {offset}, expected "
                f"{expected[:2]} at byte {expected[2]}"
            )

    def _check_bucket(self, header: Mapping[str, Any]) -> tuple[int, int]:
        """The bucket's byte range, once its version and every slot are checked."""
        self._check_version(header["version"])
        start, end = header["start"], header["end"]
        if not 0 <= start <= end <= self.layout.total:
            raise RefitError(f"refit: bucket [{start}, {end}) exceeds the layout")
        for sent in header["slots"]:
            self._check_slot(sent)
            name, offset = sent[0], sent[3]
            if name in self._seen:
                raise RefitError(f"refit: {name} arrived twice")
            if not (start <= offset and offset + self.layout.slots[name].nbytes <= end):
                raise RefitError(f"refit: {name} lies outside its bucket [{start}, {end})")
        return start, end

    def _verify(self, header: Mapping[str, Any], staged: torch.Tensor) -> None:
        if header["checksum"] is not None and checksum(staged) != header["checksum"]:
            start, end = header["start"], header["end"]
            raise RefitError(
                f"refit: bucket {header['index']} failed its checksum (bytes [{start}, {end}))"
            )
        self._seen.update(name for name, *_ in header["slots"])

    def _check_version(self, version: int) -> None:
        if version != self._incoming:
            raise RefitError(f"refit: version {version} inside a refit of {self._incoming}")
