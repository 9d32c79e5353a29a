"""BatchedDataDict: a dict of per-sample tensors (dim 0 = batch) and lists, with batch semantics."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


class BatchedDataDict(dict[str, Any]):
    """Values are tensors whose dim 0 is the batch, or lists of one item per sample.

    Slicing, selecting and sharding apply to every value alike, so a batch and its per-sample
    side-data never drift apart.
    """

    @property
    def size(self) -> int:
        """Batch size: the common length of every value (0 for an empty dict)."""
        sizes = {len(v) for v in self.values()}
        if len(sizes) > 1:
            raise ValueError(
                f"batch fields disagree on batch size: { {k: len(v) for k, v in self.items()} }"
            )
        return sizes.pop() if sizes else 0

    def slice(self, start: int, end: int) -> BatchedDataDict:
        """Samples `start:end`, as views where possible."""
        return BatchedDataDict({k: v[start:end] for k, v in self.items()})

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict:
        """Samples at `indices`, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        out = BatchedDataDict()
        for k, v in self.items():
            out[k] = (
                v[idx.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in idx.tolist()]
            )
        return out

    def shard_by_batch_size(
        self, shards: int, *, batch_size: int | None = None
    ) -> list[BatchedDataDict]:
        """Split into `shards` data-parallel shards.

        Without `batch_size`: contiguous equal shards. With it: each consecutive block of
        `batch_size` samples (a global batch) is split evenly, so every shard holds its part of
        every global batch, in order.
        """
        n = self.size
        if shards < 1 or n % shards:
            raise ValueError(f"batch of {n} does not split into {shards} equal shards")
        block = batch_size or n
        if n % block or block % shards:
            raise ValueError(
                f"batch_size={block} must divide the batch ({n}) and be divisible by {shards}"
            )
        per = block // shards
        parts: list[list[int]] = [[] for _ in range(shards)]
        for start in range(0, n, block):
            for s in range(shards):
                parts[s].extend(range(start + s * per, start + (s + 1) * per))
        return [self.select_indices(p) for p in parts]

    def make_microbatch_iterator(self, micro_batch_size: int) -> Iterator[BatchedDataDict]:
        """Consecutive micro-batches of `micro_batch_size` (the last may be smaller)."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: expected >= 1, got {micro_batch_size}")
        n = self.size
        for start in range(0, n, micro_batch_size):
            yield self.slice(start, min(start + micro_batch_size, n))

    def to(self, device: torch.device | str) -> BatchedDataDict:
        """A copy with every tensor on `device`."""
        return BatchedDataDict(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()}
        )

    @classmethod
    def from_batches(
        cls, batches: Sequence[dict[str, Any]], *, pad_value_dict: dict[str, Any] | None = None
    ) -> BatchedDataDict:
        """Concatenate batches; tensors with trailing dims of different sizes are right-padded.

        Padding uses `pad_value_dict[key]` (default 0).
        """
        if not batches:
            return cls()
        pads = pad_value_dict or {}
        keys = list(batches[0])
        for b in batches[1:]:
            if list(b) != keys:
                raise ValueError(f"from_batches: batches have different keys: {keys} vs {list(b)}")
        out = cls()
        for k in keys:
            values = [b[k] for b in batches]
            if isinstance(values[0], torch.Tensor):
                out[k] = _pad_cat(values, pads.get(k, 0))
            else:
                out[k] = [x for v in values for x in v]
        return out


def _pad_cat(tensors: list[torch.Tensor], pad_value: Any) -> torch.Tensor:
    if any(t.dim() != tensors[0].dim() for t in tensors):
        raise ValueError("from_batches: tensors for one key have different ranks")
    if tensors[0].dim() <= 1:
        return torch.cat(tensors)
    trailing = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        if list(t.shape[1:]) != trailing:
            full = t.new_full((t.shape[0], *trailing), pad_value)
            full[tuple(slice(0, s) for s in t.shape)] = t
            t = full
        padded.append(t)
    return torch.cat(padded)
