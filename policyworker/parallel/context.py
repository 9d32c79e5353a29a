"""Context parallelism: each sequence split over the CP group, balanced for causal attention.

Every (packed) sequence, padded to a multiple of 2*CP, is cut into 2*CP equal chunks; CP rank r
keeps chunks r and 2*CP-1-r, so every rank gets the same share of causal-attention work. A rank
runs the model on its local tokens only; attention all-gathers keys and values over the group
(their gradients reduce-scattered back), and the per-token outputs the loss needs are all-gathered
before the loss, which then sees the whole sequence on every CP rank. Each rank's backward then
keeps only the gradient of its own tokens, so the sum over the CP group (megatron's DP x CP
gradient reduction) is the full gradient, as without CP.

Index tensors here address a packed stream `[T]` laid out as `PackedLayout` does; `local[r]` lists
the global positions rank r holds, in its local order. They are made once per micro-batch layout
on the host and moved pinned and non-blocking (`ContextPlan`); the split travels to attention on
the THD metadata itself (`ContextSeqParams`), so no layer reads anything back from the device.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from policyworker.ops.packed import to_device


def local_positions(padded: list[int], rank: int, size: int) -> torch.Tensor:
    """[T / size] global positions of rank `rank`'s tokens: per sequence, chunks r and 2s-1-r."""
    out, start = [], 0
    for p in padded:
        chunk = p // (2 * size)
        for i in (rank, 2 * size - 1 - rank):
            out.append(torch.arange(start + i * chunk, start + (i + 1) * chunk))
        start += p
    return torch.cat(out)


def query_blocks(padded: list[int], rank: int, size: int) -> list[tuple[int, int, int]]:
    """Rank `rank`'s query blocks in local order, (global start of the sequence, chunk length,
    chunk index i): block i holds positions [i*c, (i+1)*c) of its sequence and attends to the
    sequence's keys [0, (i+1)*c), causally."""
    out, start = [], 0
    for p in padded:
        chunk = p // (2 * size)
        out += [(start, chunk, i) for i in (rank, 2 * size - 1 - rank)]
        start += p
    return out


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """One layout's index tensors on the device, made once on the host and moved pinned and
    non-blocking: what every layer's attention and the loss's gathers read."""

    blocks: tuple[tuple[int, int, int], ...]
    """`query_blocks` (host ints)."""
    local: torch.Tensor
    """[t] global positions of this rank's tokens."""
    order: torch.Tensor
    """[T] where each global position sits in the all-gather of every rank's tokens."""
    positions: torch.Tensor
    """[t] each local token's position within its sequence (RoPE)."""
    key_index: torch.Tensor
    """[sum (i+1)*c] the keys of each query block, one block after another (varlen kernels)."""
    cu_q: torch.Tensor
    """[blocks + 1] int32 offsets of the query blocks."""
    cu_k: torch.Tensor
    """[blocks + 1] int32 offsets of their keys in `key_index`."""
    max_q: int
    max_k: int


@functools.lru_cache(maxsize=16)
def _plan(padded: tuple[int, ...], rank: int, size: int, device: torch.device) -> ContextPlan:
    local, order = local_positions(list(padded), rank, size), gathered_order(list(padded), size)
    blocks = query_blocks(list(padded), rank, size)
    positions = torch.cat([torch.arange(i * c, (i + 1) * c) for _, c, i in blocks])
    keys = [torch.arange(start, start + (i + 1) * c) for start, c, i in blocks]
    q_sizes = torch.tensor([0] + [c for _, c, _ in blocks])
    k_sizes = torch.tensor([0] + [k.numel() for k in keys])
    return ContextPlan(
        blocks=tuple(blocks),
        local=to_device(local, device),
        order=to_device(order, device),
        positions=to_device(positions, device),
        key_index=to_device(torch.cat(keys), device),
        cu_q=to_device(q_sizes.cumsum(0).to(torch.int32), device),
        cu_k=to_device(k_sizes.cumsum(0).to(torch.int32), device),
        max_q=int(q_sizes.max()),
        max_k=int(k_sizes.max()),
    )


def gathered_order(padded: list[int], size: int) -> torch.Tensor:
    """[T]: for each global position, where it sits in the all-gather of every rank's tokens."""
    everyone = torch.cat([local_positions(padded, r, size) for r in range(size)])
    order = torch.empty_like(everyone)
    order[everyone] = torch.arange(everyone.numel())
    return order


@dataclass(frozen=True, slots=True)
class ContextGroup:
    """This rank's place in its CP group (size > 1)."""

    rank: int
    size: int
    group: dist.ProcessGroup

    def split(self, padded: tuple[int, ...]) -> ContextSplit:
        if any(p % (2 * self.size) for p in padded):
            raise ValueError(f"sequence lengths {padded} must be multiples of 2*CP={2 * self.size}")
        return ContextSplit(rank=self.rank, size=self.size, group=self.group, padded=padded)


@dataclass(frozen=True, slots=True)
class ContextSplit:
    """This rank's place in the CP group, for one micro-batch's packed layout."""

    rank: int
    size: int
    group: dist.ProcessGroup
    padded: tuple[int, ...]
    """Padded length of each packed sequence (each a multiple of 2 * size)."""

    def plan(self, device: torch.device) -> ContextPlan:
        """This layout's index tensors on `device` (made on the first call, then reused)."""
        return _plan(self.padded, self.rank, self.size, device)

    def local(self, device: torch.device) -> torch.Tensor:
        return self.plan(device).local

    def seq_params(self, whole: PackedSeqParams, device: torch.device) -> ContextSeqParams:
        """THD metadata for attention: queries are this rank's tokens (`cu_seqlens_q*`, T / CP),
        keys and values the whole sequences after the all-gather (`cu_seqlens_kv*`, T)."""
        local = torch.tensor([p // self.size for p in self.padded]).cumsum(0).tolist()
        cu_q = to_device(torch.tensor([0, *local], dtype=torch.int32), device)
        self.plan(device)  # made here, before the layers run
        return ContextSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_q,
            cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv=whole.cu_seqlens_kv,
            cu_seqlens_kv_padded=whole.cu_seqlens_kv_padded,
            max_seqlen_q=max(self.padded) // self.size,
            max_seqlen_kv=whole.max_seqlen_kv,
            cp_group=self.group,
            split=self,
        )

    @staticmethod
    def of(params: PackedSeqParams) -> ContextSplit | None:
        """The split a micro-batch's THD metadata carries (None without CP)."""
        if isinstance(params, ContextSeqParams):
            return params.split
        if params.cp_group is not None and dist.get_world_size(params.cp_group) > 1:
            raise TypeError("context parallelism needs the metadata of ContextSplit.seq_params")
        return None

    def gather_keys(self, x: torch.Tensor) -> torch.Tensor:
        """Local [t, ...] -> global [T, ...] in sequence order; the gradient is reduce-scattered
        back to the owners (every rank's queries may attend to every rank's keys)."""
        return _AllGatherReduceScatter.apply(x, self.group, self.size)[self.plan(x.device).order]

    def gather_outputs(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Per-token outputs, local -> global along `dim`, in sequence order. Every rank then
        computes the same loss from them, so each keeps only its own tokens' gradient."""
        moved = x.movedim(dim, 0)
        full = _AllGatherKeepOwnGrad.apply(moved.contiguous(), self.group, self.size, self.rank)
        return full[self.plan(x.device).order].movedim(0, dim)


@dataclass
class HostPacked(PackedSeqParams):
    """megatron's THD metadata plus each packed sequence's padded length on the host: a layer
    that walks the sequences one by one (a Gated DeltaNet layer) reads their bounds without a
    device read."""

    padded: tuple[int, ...] = ()

    def bounds(self) -> list[int]:
        """[0, end of sequence 1, ...] of the padded sequences."""
        return [0, *itertools.accumulate(self.padded)]


@dataclass
class ContextSeqParams(PackedSeqParams):
    """megatron's THD metadata plus the CP split it was made for (host-side: a layer needs no
    device read to know its layout)."""

    split: ContextSplit | None = field(default=None, repr=False)


class _AllGatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _AllGatherKeepOwnGrad(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int
    ) -> torch.Tensor:
        ctx.rank, ctx.n = rank, x.shape[0]
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None
