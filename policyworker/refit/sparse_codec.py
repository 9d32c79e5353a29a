"""The sparse-delta codec: which elements of a tensor changed, and their new bits, on the wire.

A delta is found by comparing the new export with the baseline through integer views of the
same width (bit equality: -0.0 and 0.0 differ, NaNs compare by payload), and carries the changed
flat positions (int32, int64 past 2^31 elements) and the new values' bits — absolute values, not
XOR: applying a payload twice, or one a retry sent again, writes the same bits, so a duplicate
can never corrupt a receiver.

A payload is some tensors' deltas, serialized without pickle (it arrives from the network):

    [4-byte little-endian header length][JSON header][index and value bytes, in header order]

compressed with zstd (level 1) and guarded by a CRC-32 of the compressed bytes. The header
lists, per tensor, `[name, shape, dtype, element count, index dtype or "dense"]`: a tensor
where most elements changed goes dense (all its values, no positions), which is smaller. The
positions go as gaps (the first position, then each one's distance from the one before): small
numbers, which compress to a fraction of the positions themselves. On a delta of 1.5% of a
bf16 tensor, zstd on gaps wrote 15% fewer bytes than zlib on positions, 9x faster.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import zstandard


class _Zstd(threading.local):
    """This thread's zstd compressor: one used by two threads at once corrupts its state
    (python-zstandard's objects are not thread-safe) — a sender thread and a receiver in one
    process crashed the interpreter in zstd's C code. A decode makes its own stream."""

    def __init__(self) -> None:
        self.compress = zstandard.ZstdCompressor(level=1).compress


_ZSTD = _Zstd()

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    )
}


class PayloadError(ValueError):
    """A payload that does not decode: a wrong checksum, a truncated or malformed body."""


@dataclass(frozen=True, slots=True)
class TensorDelta:
    """The changed elements of one tensor: flat positions and their new values' bits."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    index: torch.Tensor | None
    """[n] int32 (int64 for tensors of 2^31 elements or more), ascending; None: dense (every
    element, in order: cheaper once positions and values outweigh the values alone)."""
    values: torch.Tensor
    """[n] the new values, in `dtype`."""
    changed: int
    """Elements whose bits changed (of a dense delta too)."""

    @property
    def nbytes(self) -> int:
        index = 0 if self.index is None else self.index.numel() * self.index.itemsize
        return index + self.values.numel() * self.dtype.itemsize


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened, as integers of its element width (a view)."""
    return t.reshape(-1).view(_INT_OF_WIDTH[t.dtype.itemsize])


def delta(name: str, new: torch.Tensor, base: torch.Tensor) -> TensorDelta:
    """The elements of `new` whose bits differ from `base` (same shape and dtype), on CPU."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"{name}: {tuple(new.shape)} {new.dtype} against a baseline of "
                         f"{tuple(base.shape)} {base.dtype}")  # fmt: skip
    new_bits = bits(new)
    where = (new_bits != bits(base.to(new.device))).nonzero().squeeze(1)
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    shape = tuple(new.shape)
    if where.numel() * (index_dtype.itemsize + new.dtype.itemsize) >= new.nbytes:
        dense = new.reshape(-1).cpu().clone()
        return TensorDelta(name, shape, new.dtype, None, dense, where.numel())
    values = new.reshape(-1)[where].cpu()
    return TensorDelta(name, shape, new.dtype, where.to(index_dtype).cpu(), values, where.numel())


def whole(d: TensorDelta, new: torch.Tensor) -> TensorDelta:
    """`d` as a dense delta of all of `new` (a full resync), keeping its changed count."""
    if d.index is None:
        return d
    return TensorDelta(d.name, d.shape, d.dtype, None, new.reshape(-1).cpu().clone(), d.changed)


def apply_delta(target: torch.Tensor, d: TensorDelta) -> None:
    """Write the delta's bits into `target` (in place; any device)."""
    flat = bits(target)
    if d.index is None:
        flat.copy_(bits(d.values))
        return
    flat[d.index.to(flat.device, torch.int64)] = bits(d.values).to(flat.device)


def encode(deltas: list[TensorDelta]) -> tuple[bytes, int]:
    """(compressed payload, its CRC-32)."""
    header = [
        [d.name, list(d.shape), str(d.dtype).removeprefix("torch."), d.values.numel(),
         "dense" if d.index is None else str(d.index.dtype).removeprefix("torch.")]
        for d in deltas
    ]  # fmt: skip
    head = json.dumps(header).encode()
    parts = [len(head).to_bytes(4, "little"), head]
    for d in deltas:
        parts += ([] if d.index is None else [_raw(_gaps(d.index))]) + [_raw(d.values)]
    body = _ZSTD.compress(b"".join(parts))
    return body, zlib.crc32(body)


Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""What a receiver holds: each tensor's shape and dtype by name (its refit info)."""


def raw_bound(expected: Expected) -> int:
    """The most bytes a payload for `expected` may decode to: each tensor at most once, and a
    sparse delta is only sent while smaller than the tensor (`delta`), so at most its bytes."""
    tensors = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in expected.values())
    return 4 + _header_bound(expected) + tensors


def _header_bound(expected: Expected) -> int:
    return 1024 + sum(len(name) + 128 for name in expected)


def decode(body: bytes, crc: int, expected: Expected) -> list[TensorDelta]:
    """The deltas of a payload; `PayloadError` if it is not what was sent or not for
    `expected`. Decompressed as a stream: the header first, checked against `expected`
    (names, shapes, dtypes, counts), then exactly the bytes it announces — nothing larger than
    what the receiver holds is ever allocated, whatever the frame claims."""
    if zlib.crc32(body) != crc:
        raise PayloadError("payload checksum mismatch (corrupted in transit)")
    try:
        stream = zstandard.ZstdDecompressor().stream_reader(body)
        size = int.from_bytes(_read(stream, 4), "little")
        if size > _header_bound(expected):
            raise ValueError(f"a header of {size} bytes")
        entries = [_entry(e, expected) for e in json.loads(_read(stream, size))]
        if len({e[0] for e in entries}) < len(entries):
            raise ValueError("a tensor twice in one payload")
        out = []
        for name, shape, dtype, count, index_dtype in entries:
            index = None
            if index_dtype is not None:
                gaps = _tensor(_read(stream, count * index_dtype.itemsize), index_dtype)
                index = gaps.cumsum(0, dtype=torch.int64)
                if count and (int(index.min()) < 0 or int(index.max()) >= shape.numel()):
                    raise ValueError(f"{name}: a position outside its {shape.numel()} elements")
                index = index.to(index_dtype)
            values = _tensor(_read(stream, count * dtype.itemsize), dtype)
            out.append(TensorDelta(name, tuple(shape), dtype, index, values, count))
        if stream.read(1):
            raise ValueError("trailing bytes")
    except (zstandard.ZstdError, ValueError, KeyError, TypeError) as e:
        raise PayloadError(f"payload does not decode: {e}") from None
    return out


def _entry(
    entry: object, expected: Expected
) -> tuple[str, torch.Size, torch.dtype, int, torch.dtype | None]:
    """A header entry `[name, shape, dtype, count, index dtype or "dense"]`, checked against
    what the receiver holds (`ValueError` naming what is wrong)."""
    if not (isinstance(entry, list) and len(entry) == 5):
        raise ValueError(f"a header entry {str(entry)[:80]}")
    name, shape, dtype, count, index = entry
    if name not in expected:
        raise ValueError(f"{str(name)[:80]} is not in this engine's refit info")
    want_shape, want_dtype = expected[name]
    if shape != list(want_shape) or _DTYPES.get(dtype) != want_dtype:
        raise ValueError(
            f"{name} sent as {shape} {dtype}, expected {list(want_shape)} {want_dtype}"
        )
    numel, itemsize = torch.Size(want_shape).numel(), want_dtype.itemsize
    if index == "dense":
        if count != numel:
            raise ValueError(f"{name}: a dense delta of {count} elements")
        return name, torch.Size(want_shape), want_dtype, count, None
    if index not in ("int32", "int64") or not isinstance(count, int) or count < 0:
        raise ValueError(f"{name}: positions {index!r}, count {count!r}")
    index_dtype = _DTYPES[index]
    if count * (index_dtype.itemsize + itemsize) > numel * itemsize:  # larger than dense
        raise ValueError(f"{name}: {count} positions of {numel} elements")
    return name, torch.Size(want_shape), want_dtype, count, index_dtype


def _read(stream: object, n: int) -> bytes:
    """Exactly `n` decompressed bytes (a stream may return fewer per read)."""
    parts, left = [], n
    while left:
        chunk = stream.read(left)  # type: ignore[attr-defined]
        if not chunk:
            raise ValueError("truncated")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _tensor(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)


def _gaps(index: torch.Tensor) -> torch.Tensor:
    """Ascending positions as the first one and the distances between neighbours."""
    return torch.diff(index, prepend=index.new_zeros(1)) if index.numel() else index


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
