"""What a refit carries and where each tensor sits — the wire format every transport shares:
refit info, the byte layout, buckets, their headers, checksums, and the sender's report.

Refit info is `{hf_name: (shape, dtype)}` of the whole model in the Hugging Face layout, in the
order the sender sends. Both sides derive the same `Layout` from it: every tensor at a 512-byte
aligned offset of one flat byte range, cut into buckets of at most `bucket_bytes` (a tensor larger
than that is a bucket of its own). A bucket's bytes are `layout[start:end]`, so the receiver stages
a whole bucket with one copy and the checksum covers exactly what was staged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.ops.packed import round_up

ALIGN = 512

RefitInfo = dict[str, tuple[tuple[int, ...], torch.dtype]]


class RefitError(RuntimeError):
    """A refit that did not complete: a peer that died or timed out, a rejected bucket, a
    mismatch with the refit info. The receiver's live weights are unchanged."""


@dataclass(frozen=True, slots=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    def view(self, flat: torch.Tensor, base: int = 0) -> torch.Tensor:
        """This tensor inside `flat` (uint8) whose first byte is layout offset `base`."""
        start = self.offset - base
        return flat[start : start + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int
    slots: tuple[Slot, ...]
    start: int
    end: int
    """Layout bytes [start, end): the slots and their alignment padding."""

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class Layout:
    """Slots and buckets of a refit info, the same on sender and receiver."""

    def __init__(self, info: RefitInfo, bucket_bytes: int | None) -> None:
        """`bucket_bytes=None`: slots only (a receiver does not cut buckets). Callers check
        a user's size (`refit.weights.check_refit_args`)."""
        assert bucket_bytes is None or bucket_bytes >= ALIGN, bucket_bytes
        self.info = dict(info)
        self.bucket_bytes = bucket_bytes
        self.slots: dict[str, Slot] = {}
        offset = 0
        for name, (shape, dtype) in info.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            self.slots[name] = Slot(name, tuple(shape), dtype, offset, nbytes)
            offset += round_up(nbytes, ALIGN)
        self.total = offset
        self.buckets = [] if bucket_bytes is None else _cut(list(self.slots.values()), bucket_bytes)

    @property
    def buffer_bytes(self) -> int:
        """A sender's reusable buffer: the largest regular bucket (a tensor larger than
        `bucket_bytes` is a bucket of its own and gets a buffer of its own)."""
        assert self.bucket_bytes is not None
        return max((b.nbytes for b in self.buckets if b.nbytes <= self.bucket_bytes), default=0)


def _cut(slots: list[Slot], bucket_bytes: int) -> list[Bucket]:
    buckets: list[Bucket] = []
    group: list[Slot] = []

    def close() -> None:
        if group:
            end = group[-1].offset + round_up(group[-1].nbytes, ALIGN)
            buckets.append(Bucket(len(buckets), tuple(group), group[0].offset, end))
            group.clear()

    for slot in slots:
        if group and slot.offset + round_up(slot.nbytes, ALIGN) - group[0].offset > bucket_bytes:
            close()
        group.append(slot)
    close()
    return buckets


def pack(bucket: Bucket, buf: torch.Tensor, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy the bucket's next tensors from `tensors` into `buf` (uint8, layout byte
    `bucket.start` first), checking each against the refit info."""
    for slot in bucket.slots:
        name, tensor = next(tensors)
        if name != slot.name or tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise RefitError(
                f"refit info: the model gives {name} {tuple(tensor.shape)} {tensor.dtype}, the "
                f"refit info says {slot.name} {slot.shape} {slot.dtype}"
            )
        slot.view(buf, base=bucket.start).copy_(tensor)


def checksum(data: torch.Tensor) -> int:
    """Sum of the bytes as int64 words (wrapping): one changed byte changes it. `data` is uint8
    of a multiple of 8 bytes (buckets are 512-byte aligned)."""
    return int(checksum_on_device(data))


def checksum_on_device(data: torch.Tensor) -> torch.Tensor:
    """`checksum` as a tensor where `data` lives, without waiting for it: in one read and no
    temporary (an int32 view summed in int64 would first copy it at twice the size)."""
    return data.view(torch.int64).sum()


def check_targets(info: RefitInfo, targets: Mapping[str, torch.Tensor]) -> None:
    """The receiver's tensors must be exactly the refit info's names, shapes and dtypes."""
    missing, extra = sorted(set(info) - set(targets)), sorted(set(targets) - set(info))
    if missing or extra:
        raise ValueError(
            f"refit info: the receiver's weights differ in names (not received: {missing[:3]}, "
            f"not sent: {extra[:3]})"
        )
    for name, (shape, dtype) in info.items():
        t = targets[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"refit info: {name} is sent as {tuple(shape)} {dtype}, the receiver holds "
                f"{tuple(t.shape)} {t.dtype}"
            )


SlotHeader = tuple[str, list[int], str, int, int]
"""(name, shape, dtype name, layout offset, nbytes) of one tensor, as messages carry it."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def slot_headers(slots: Iterable[Slot]) -> list[SlotHeader]:
    return [(s.name, list(s.shape), dtype_name(s.dtype), s.offset, s.nbytes) for s in slots]


def bucket_header(bucket: Bucket, version: int, total: int | torch.Tensor | None) -> dict[str, Any]:
    """What a receiver stages a bucket by: its place in the layout, its slots and checksum."""
    return {
        "type": "bucket",
        "version": version,
        "index": bucket.index,
        "start": bucket.start,
        "end": bucket.end,
        "slots": slot_headers(bucket.slots),
        "checksum": total,
    }


@dataclass(frozen=True, slots=True)
class RefitReport:
    """What a refit moved, as the sender saw it."""

    version: int
    bytes: int
    seconds: float
    names: int
    buckets: int
    checksum: bool

    @classmethod
    def of(cls, layout: Layout, version: int, seconds: float, use_checksum: bool) -> RefitReport:
        return cls(
            version=version,
            bytes=layout.total,
            seconds=seconds,
            names=len(layout.slots),
            buckets=len(layout.buckets),
            checksum=use_checksum,
        )

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-12) / 1e9
