"""Bin packing of sequences into token budgets, and the packed (THD) layout of one bin.

A packer maps item sizes to bins of item indices, every bin's total <= the capacity:

* `first_fit_decreasing`: largest first, each into the first bin with room.
* `modified_first_fit_decreasing`: Johnson & Garey's MFFD — one bin per large item (> C/2), a
  medium item (> C/3) added to each, pairs of small items (> C/6) to bins without a medium one,
  then the rest greedily, largest first, and a least-loaded-bin pass on what is left.
* `concatenative`: in order, a new bin whenever the next item does not fit.
* `sorted_cuts` (token-budget micro-batches without packing): sizes are the padded cost
  `n * longest`; sort by size and cut where the next item would exceed the budget.

`PackedLayout` lays one bin's sequences end to end: each padded to a multiple of
`divisible_by`, the bin padded to `total` by lengthening its last sequence (so every token belongs
to a sequence and attention never reads an unassigned token).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from policyworker.ops.packed import packed_positions, round_up, to_device
from policyworker.parallel.context import HostPacked

Bins = list[list[int]]


def first_fit_decreasing(sizes: list[int], capacity: int) -> Bins:
    bins: Bins = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, free in enumerate(room):
            if sizes[i] <= free:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


def modified_first_fit_decreasing(sizes: list[int], capacity: int) -> Bins:
    by_size = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    large = [i for i in by_size if sizes[i] > capacity / 2]
    medium = [i for i in by_size if capacity / 3 < sizes[i] <= capacity / 2]
    small = [i for i in reversed(by_size) if capacity / 6 < sizes[i] <= capacity / 3]  # ascending
    tiny = [i for i in by_size if sizes[i] <= capacity / 6]
    bins = [[i] for i in large]

    def free(b: list[int]) -> int:
        return capacity - sum(sizes[i] for i in b)

    for b in bins:  # one medium item per large bin, the largest that fits
        fit = next((m for m in medium if sizes[m] <= free(b)), None)
        if fit is not None:
            medium.remove(fit)
            b.append(fit)
    for b in reversed(bins):  # two small items into bins without a medium one
        if len(b) > 1 or len(small) < 2 or sizes[small[0]] + sizes[small[1]] > free(b):
            continue
        first = small.pop(0)
        second = next((s for s in reversed(small) if sizes[s] <= free(b) - sizes[first]), None)
        small.remove(second)  # exists: small[0] (now) fitted alongside `first` above
        b += [first, second]
    rest = sorted(medium + small + tiny, key=lambda i: (-sizes[i], i))
    for b in bins:  # the rest, greedily, largest that fits
        while rest and sizes[rest[-1]] <= free(b):
            fit = next(i for i in rest if sizes[i] <= free(b))
            rest.remove(fit)
            b.append(fit)
    return bins + _ffd_sorted(rest, sizes, capacity)


def _ffd_sorted(items: list[int], sizes: list[int], capacity: int) -> Bins:
    """MFFD's last phase on items sorted largest first, in O(n log n): each item goes to the
    least-loaded bin if it fits there (then it fits nowhere else either), else to a new bin."""
    bins: Bins = []
    loads: list[int] = []
    for i in items:
        if bins and sizes[i] <= capacity - loads[0]:
            b, load = bins.pop(0), loads.pop(0)
        else:
            b, load = [], 0
        b.append(i)
        load += sizes[i]
        at = bisect.bisect(loads, load)
        bins.insert(at, b)
        loads.insert(at, load)
    return bins


def concatenative(sizes: list[int], capacity: int) -> Bins:
    bins: Bins = []
    load = capacity + 1
    for i, size in enumerate(sizes):
        if load + size > capacity:
            bins.append([])
            load = 0
        bins[-1].append(i)
        load += size
    return bins


PACKERS: dict[str, Callable[[list[int], int], Bins]] = {
    "first_fit_decreasing": first_fit_decreasing,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "concatenative": concatenative,
}


def sorted_cuts(lengths: list[int], capacity: int) -> Bins:
    """Token-budget micro-batches without packing: rows sorted by length, each micro-batch as
    many as fit when padded to its own longest (`n * longest <= capacity`)."""
    bins: Bins = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if bins and (len(bins[-1]) + 1) * max(longest, lengths[i]) <= capacity:
            bins[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            bins.append([i])
            longest = lengths[i]
    return bins


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Sequences of one bin laid end to end: `[1, total]` tokens, sequence j at `starts[j]`."""

    lengths: tuple[int, ...]
    """True length of each sequence, in bin order."""
    padded: tuple[int, ...]
    """Slots of each sequence (a multiple of the divisor; the last also absorbs the bin padding)."""

    @classmethod
    def of(cls, lengths: list[int], *, divisible_by: int, total: int | None = None) -> PackedLayout:
        padded = [round_up(n, divisible_by) for n in lengths]
        if total is not None:
            assert total >= sum(padded) and total % divisible_by == 0, (total, padded)
            padded[-1] += total - sum(padded)
        return cls(lengths=tuple(lengths), padded=tuple(padded))

    @property
    def total(self) -> int:
        return sum(self.padded)

    @property
    def starts(self) -> list[int]:
        return [0, *itertools.accumulate(self.padded)][:-1]

    def positions(self, device: torch.device) -> torch.Tensor:
        """[1, T] position ids, restarting at 0 for every sequence (RoPE per sequence)."""
        cu = torch.tensor([*self.starts, self.total])
        return to_device(packed_positions(cu, self.total)[None, :], device)

    def seq_params(self, device: torch.device) -> PackedSeqParams:
        """megatron's THD metadata: cu_seqlens of the true and of the padded lengths."""

        def cumulative(sizes: tuple[int, ...]) -> torch.Tensor:
            return to_device(
                torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32), device
            )

        cu, cu_padded = cumulative(self.lengths), cumulative(self.padded)
        longest = max(self.padded)
        return HostPacked(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            padded=self.padded,
        )

    def _tokens(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices of every real token, built on the host: (its slot in the flattened [n, width]
        rows, its packed position)."""
        rows = [torch.arange(n) + j * width for j, n in enumerate(self.lengths)]
        packed = [torch.arange(n) + s for n, s in zip(self.lengths, self.starts, strict=True)]
        return to_device(torch.cat(rows), device), to_device(torch.cat(packed), device)

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, S, *rest] (row j valid up to lengths[j]) -> [1, T, *rest], zeros in the padding."""
        src, dst = self._tokens(rows.shape[1], rows.device)
        out = rows.new_zeros((self.total, *rows.shape[2:]))
        out[dst] = rows.flatten(0, 1)[src]
        return out[None]

    def unpack(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        """[1, T, *rest] -> [n, width, *rest]: row j's first lengths[j] positions, zeros after.
        Differentiable (a gather; its gradient scatters back)."""
        src, dst = self._tokens(width, packed.device)
        out = packed.new_zeros((len(self.lengths) * width, *packed.shape[2:]))
        out[src] = packed[0][dst]
        return out.unflatten(0, (len(self.lengths), width))
