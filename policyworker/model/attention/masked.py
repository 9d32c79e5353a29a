"""A layer's softmax, a small type chosen when the layer is built (`CoreAttention.softmax`):

* `Causal`: every key up to the query; the phase's kernels run it (`kernels.py`, `cached.py`).
* `Masked`: a sliding window (a query reaches itself and the `window - 1` keys before it, HF's
  `kv > q - window`) and/or learned sinks (gpt-oss: a per-head logit s_h in every query's
  softmax denominator — softmax over [scores, s_h], the sink's share dropped). It runs its own
  exact kernels in every layout and phase: SDPA under a float mask where the sink is a zero
  key/value column whose mask entry is s_h, so SDPA's own backward gives the sink's gradient.

The masked path builds a [heads, queries, keys] mask per call: exact on every device, but its
memory grows with the square of a sequence's length. On a GPU in half precision training and
scoring run flash attention instead, the window flash's own and the sink taken through the
softmax's log-sum-exp (`sink_flash.py`); CP blocks and the KV cache keep the exact masks.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from policyworker.model.attention.kernels import chunk_spans, same_sequence
from policyworker.model.attention.layout import CachedKernel, Kernels, Packed
from policyworker.model.attention.sink_flash import SinkFlash, VarlenKernel
from policyworker.parallel.context import ContextPlan


class Causal:
    """Plain causal attention: whatever the phase runs."""

    def kernels(self, phase: Kernels) -> Kernels:
        return phase

    def cached(self, phase: CachedKernel) -> CachedKernel:
        return phase


def reach(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[..., sq, sk]: the keys (at `k_pos` [..., sk]) each query (at `q_pos` [..., sq])
    reaches: causal, and within `window` (0: unbounded)."""
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    ok = k <= q
    return ok & (k > q - window) if window else ok


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [b, np, sq, d] against k/v [b, ng, sk, d] where `allowed` [b or 1, 1, sq, sk]; `sinks`
    [np]: each head's sink logit (None: none)."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa
        )
    heads, sq = q.shape[1:3]
    b = allowed.shape[0]  # 1 where every row has the same positions: the mask broadcasts
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~allowed, float("-inf"))
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(b, heads, sq, 1)
    mask = torch.cat([bias.expand(b, heads, sq, -1), sink], dim=-1)
    k, v = (torch.cat([x, x.new_zeros(*x.shape[:2], 1, x.shape[-1])], dim=2) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class Masked:
    """A window and/or sinks (module docstring). `sinks` is the layer's parameter (TP: this
    rank's heads), held, not copied: it trains."""

    def __init__(self, window: int, sinks: torch.nn.Parameter | None) -> None:
        self.window, self.sinks = window, sinks
        self.fast: Kernels = self
        """What training and scoring run: these exact masks, or flash (`on_flash`)."""

    def on_flash(self, kernel: VarlenKernel) -> None:
        """Train and score on flash attention with `kernel` (a GPU in half precision:
        `ForwardPaths.install`); CP blocks and generation keep the exact masks."""
        self.fast = SinkFlash(self.window, self.sinks, self, kernel)

    def kernels(self, phase: Kernels) -> Kernels:
        return self.fast

    def cached(self, phase: CachedKernel) -> CachedKernel:
        return self.over_cache

    def padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        pos = torch.arange(q.shape[2], device=q.device)
        return masked_sdpa(q, k, v, reach(pos, pos, self.window)[None, None], scale, self.sinks)

    def packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Packed, scale: float
    ) -> torch.Tensor:
        """Consecutive sequences a chunk at a time, each chunk under one mask (its sequences
        apart); tokens after the last sequence get zeros."""
        out = torch.zeros_like(q)
        spans = [(a, b) for a, b in itertools.pairwise(where.cu_q.tolist()) if b > a]
        for group in chunk_spans(spans):
            start, end = group[0][0], group[-1][1]
            pos = where.positions[start:end, 0]
            allowed = reach(pos, pos, self.window) & same_sequence(group, q.device)
            qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
            o = masked_sdpa(qs, ks, vs, allowed[None, None], scale, self.sinks)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextPlan, scale: float
    ) -> torch.Tensor:
        """Every CP query block against its sequence's keys up to the block's end."""
        out = torch.empty_like(q)
        row = 0
        for start, chunk, i in plan.blocks:
            end = (i + 1) * chunk
            qs = q[row : row + chunk].transpose(0, 1)[None]
            ks, vs = (x[start : start + end].transpose(0, 1)[None] for x in (k, v))
            q_pos = torch.arange(i * chunk, end, device=q.device)
            allowed = reach(q_pos, torch.arange(end, device=q.device), self.window)
            o = masked_sdpa(qs, ks, vs, allowed[None, None], scale, self.sinks)
            out[row : row + chunk] = o[0].transpose(0, 1)
            row += chunk
        return out

    def over_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Generation: q [b, np, s, hn] against the cache's k/v [b, ng, n, hn], each query at
        its position ([s, b])."""
        keys = torch.arange(k.shape[2], device=q.device)
        allowed = reach(positions.T, keys, self.window)[:, None]  # [b, 1, s, n]
        return masked_sdpa(q, k, v, allowed, scale, self.sinks)
