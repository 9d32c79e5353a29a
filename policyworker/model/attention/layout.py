"""Where a forward's tokens sit, read once from what megatron hands the core attention.

Three layouts, each a small type that knows its tokens' RoPE positions and how its tensors meet
a `Kernels` (the phase's attention kernels):
* `Padded` (sbhd): query [s, b, np, hn], key/value [s, b, ng, hn] -> [s, b, np*hn]; positions
  0..s-1 in every row (right padding never leaks into earlier positions under a causal mask);
* `Packed` (thd, `qkv_format == "thd"`): query [t, np, hn], key/value [t, ng, hn] with
  cu_seqlens -> [t, np*hn]; positions restart at every sequence;
* `Split` (thd under context parallelism): this rank's tokens against every rank's keys.
Attention is always causal; the mask megatron passes is ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from policyworker.ops.packed import packed_positions
from policyworker.parallel.context import ContextPlan, ContextSplit

CachedKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
"""Generation's attention over a KV cache (`cached.py`): q [b, np, s, hn] against the cache's
k/v [b, ng, n, hn], each query reaching the keys up to its position ([s, b]), with a softmax
scale -> [b, np, s, hn]."""


class Kernels(Protocol):
    """Causal attention over a forward's own tokens, one method per layout (`model/attention/
    kernels.py` has the implementations; a phase holds one)."""

    def padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [b, np, s, hn], k/v [b, ng, s, hn] -> [b, np, s, hn]."""
        ...

    def packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Packed, scale: float
    ) -> torch.Tensor:
        """q [t, np, hn], k/v [t, ng, hn], causal within each sequence -> [t, np, hn]."""
        ...

    def split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextPlan, scale: float
    ) -> torch.Tensor:
        """This rank's q [t, np, hn] against the gathered k/v [T, ng, hn] -> [t, np, hn]."""
        ...


class Where(Protocol):
    positions: torch.Tensor
    """Each token's RoPE position, broadcastable to the queries' leading dims (plus a 1)."""

    def attend(
        self, kernels: Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Rotated q, k and v through `kernels` -> [tokens..., np * hn]."""
        ...


@dataclass(frozen=True, slots=True)
class Padded:
    positions: torch.Tensor  # [s, 1, 1]

    def attend(
        self, kernels: Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        sq, b = q.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [s, b, h, d] -> [b, h, s, d]
        return kernels.padded(q, k, v, scale).permute(2, 0, 1, 3).reshape(sq, b, -1)


@dataclass(frozen=True, slots=True)
class Packed:
    positions: torch.Tensor  # [t, 1]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    params: PackedSeqParams

    def attend(
        self, kernels: Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        out = kernels.packed(q, k, v, self, scale)
        return out.reshape(out.shape[0], -1)


@dataclass(frozen=True, slots=True)
class Split:
    positions: torch.Tensor  # [t, 1]
    split: ContextSplit
    plan: ContextPlan

    def attend(
        self, kernels: Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        k, v = self.split.gather_keys(k), self.split.gather_keys(v)  # [T, ng, hn]
        out = kernels.split(q, k, v, self.plan, scale)
        return out.reshape(out.shape[0], -1)


def locate(query: torch.Tensor, params: PackedSeqParams | None) -> Where:
    """The layout of megatron's arguments. Under CP, each local token's RoPE position is its
    position in its whole sequence, from the micro-batch's plan (made once: no host sync here)."""
    if params is None or params.qkv_format != "thd":
        return Padded(torch.arange(query.shape[0], device=query.device)[:, None, None])
    split = ContextSplit.of(params)
    if split is not None:
        plan = split.plan(query.device)
        return Split(plan.positions[:, None], split, plan)
    cu_q = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
    cu_k = (
        params.cu_seqlens_kv if params.cu_seqlens_kv_padded is None else params.cu_seqlens_kv_padded
    )
    return Packed(packed_positions(cu_q, query.shape[0])[:, None], cu_q, cu_k, params)
