"""How the driver runs a worker call on a group: what each call declares, and the batch plumbing.

A call's batch argument is split over data parallel: each replica (its TP x CP x PP ranks) gets
the same shard, and the shards are balanced by tokens. Its outputs are taken from each replica's
leader and put back in the caller's order. Every other argument goes to every rank as given,
except the `per_rank` ones, which the caller may give as one value per rank.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.data.batched_data_dict import BatchedDataDict


class Output(enum.Enum):
    BATCH = "batch"
    """Each replica leader's batch for its shard, merged in the caller's order."""
    FIRST = "first"
    """Rank 0's answer (train metrics are reduced over the group already)."""
    ALL = "all"
    """Every rank's answer, in rank order (e.g. each rank's refit address)."""


class Split(enum.Enum):
    BALANCED = "balanced"
    """Equal row counts per shard, balanced by tokens (logprob and top-k calls)."""
    GLOBAL_BATCHES = "global_batches"
    """Each global batch (`gbs` rows) split so, in order; whole examples stay together (train)."""
    CONTIGUOUS = "contiguous"
    """Equal consecutive slices (a chunk of a split step: it keeps its row order)."""


@dataclass(frozen=True, slots=True)
class Call:
    """What one worker method declares to the driver."""

    output: Output = Output.FIRST
    sharded: str | None = None
    """The argument holding a batch to split over data parallel (None: nothing is split)."""
    split: Split = Split.BALANCED
    per_rank: tuple[str, ...] = ()
    """Arguments that may be given as a list of one value per rank."""
    indexed: bool = False
    """Each row of the batch carries its index in the caller's batch (`row_ids`, unless the
    caller gave them) to its shard: generation keys a row's draws by it, so they do not depend
    on the number of shards."""


def balanced_split(lengths: Sequence[int], shards: int, unit: int = 1) -> list[list[int]]:
    """Row indices of each shard, ascending.

    Examples of `unit` consecutive rows stay together. Each shard gets as many examples as the
    others (the first ones one more if they do not divide); the longest example goes first, each
    to the shard with the fewest tokens that still has room.
    """
    n = len(lengths) // unit
    tokens = [sum(lengths[u * unit : (u + 1) * unit]) for u in range(n)]
    room = [n // shards + (s < n % shards) for s in range(shards)]
    load, members = [0] * shards, [[] for _ in range(shards)]
    for u in sorted(range(n), key=lambda u: (-tokens[u], u)):
        s = min((s for s in range(shards) if room[s]), key=lambda s: (load[s], s))
        room[s] -= 1
        load[s] += tokens[u]
        members[s].extend(range(u * unit, (u + 1) * unit))
    return [sorted(m) for m in members]


def split_rows(
    lengths: Sequence[int], shards: int, split: Split, *, block: int, unit: int
) -> list[list[int]]:
    """Row indices of each data-parallel shard for `split` (`block`: the global batch size)."""
    n = len(lengths)
    if split is Split.CONTIGUOUS:
        per = n // shards
        return [list(range(s * per, (s + 1) * per)) for s in range(shards)]
    if split is Split.BALANCED:
        return balanced_split(lengths, shards)
    out: list[list[int]] = [[] for _ in range(shards)]
    for start in range(0, n, block):
        parts = balanced_split(lengths[start : start + block], shards, unit)
        for s, part in enumerate(parts):
            out[s].extend(start + i for i in part)
    return out


def merge(
    parts: Sequence[BatchedDataDict],
    rows: Sequence[Sequence[int]],
    pads: dict[str, Any] | None = None,
) -> BatchedDataDict:
    """The shards' outputs as one batch, row i being the caller's row i; shards of different
    widths (generated rows) are right-padded with `pads[key]` (default 0)."""
    joined = BatchedDataDict.from_batches(list(parts), pad_value_dict=pads)
    order = torch.tensor([i for r in rows for i in r], dtype=torch.long)
    return joined.select_indices(torch.argsort(order))
