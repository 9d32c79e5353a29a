"""Token logprobs, top-k and entropy from vocab-parallel logits, computed chunk by chunk.

A micro-batch's logits are `hidden @ W.T`, with W this TP rank's rows of the vocabulary
[V/tp, H]. A `Head` holds the two factors; `logprobs_at`, `entropy` and `topk` take the logits
`chunk_tokens` rows at a time: the output layer's matmul, the log-softmax and the picks run per
chunk and only [N]-sized statistics survive a chunk. The backward recomputes each chunk's logits
and forms the chunk's gradient for the hidden states and for W, so no more than one chunk's
logits exist at any time, forward or backward (`chunk_tokens=None`: one chunk, whose logits are
kept for the backward, as a plain matmul would). `Head.of_logits` wraps logits that are already
there (the logits-level functions at the end).

Everything is exact under any TP size: the log-softmax reduces the row max (all-reduce MAX), the
sum of exp and the picked logits (all-reduce SUM) over the TP group; every backward is local,
e.g. `(onehot - softmax) / temperature` on each rank's slice. Top-k gathers the per-rank
candidates. The logit passes are `cuda_compiled`: on GPU each is one fused kernel reading the
(bf16) logits once, with no fp32 [N, V] copy.

Alignment (docs/semantics.md): `logprobs[:, i] = log p(ids[:, i] | ids[:, :i])`, position 0 is 0;
entropy, top-k and index logprobs at i describe the distribution of token i+1 (the logits at i).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from policyworker.ops.compiled import cuda_compiled


@dataclass(frozen=True, slots=True, kw_only=True)
class LogitOptions:
    """How logits are read: temperature, the vocabulary's TP split, and the chunk size."""

    temperature: float
    tp_group: dist.ProcessGroup | None
    tp_rank: int = 0
    vocab_size: int | None = None
    """The true vocabulary: columns past it (the output layer's TP padding) never count."""
    chunk_tokens: int | None = None
    """Logit rows per chunk; None: all rows at once."""


@dataclass(frozen=True, slots=True)
class Head:
    """A micro-batch's logits, `hidden @ weight.T` ([B, S, V/tp]), not computed yet."""

    hidden: torch.Tensor
    """[B, S, H] final hidden states, batch-major (all-gathered under sequence parallelism)."""
    weight: torch.Tensor | None
    """[V/tp, H] this TP rank's output-layer rows; None: `hidden` are the logits themselves."""

    @classmethod
    def of_logits(cls, logits: torch.Tensor) -> Head:
        return cls(logits, None)

    @property
    def part(self) -> int:
        """Vocabulary columns of this TP rank (padding included)."""
        return self.hidden.shape[-1] if self.weight is None else self.weight.shape[0]


def wide(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32 for bf16/fp32 logits, fp64 for fp64 (exact tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@cuda_compiled
def _max_and_picked(
    x: torch.Tensor, target: torch.Tensor, inside: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max [n] and the logits at `target` [n, k] (0 where this rank does not own the id)."""
    x32 = wide(x) * inv_t
    picked = x32.gather(-1, target)
    return x32.amax(-1), torch.where(inside, picked, torch.zeros_like(picked))


@cuda_compiled
def sum_exp(x: torch.Tensor, row_max: torch.Tensor, inv_t: float) -> torch.Tensor:
    """[1, n]: sum(exp(x / T - max))."""
    return torch.exp(wide(x) * inv_t - row_max[:, None]).sum(-1)[None]


@cuda_compiled
def _exp_sums(x: torch.Tensor, row_max: torch.Tensor, inv_t: float) -> torch.Tensor:
    """[2, n]: sum(e) and sum(e * y) with y = x / T - max, e = exp(y) (the second for entropy)."""
    y = wide(x) * inv_t - row_max[:, None]
    e = torch.exp(y)
    return torch.stack([e.sum(-1), (e * y).sum(-1)])


@cuda_compiled
def _grad_one(
    x: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    inside: torch.Tensor,
    grad: torch.Tensor,
    inv_t: float,
) -> torch.Tensor:
    """k = 1 (token logprobs): (onehot(target) - softmax) / T times the incoming grad, one pass."""
    softmax = torch.exp(wide(x) * inv_t - lse[:, None])
    cols = torch.arange(x.shape[-1], device=x.device)[None, :]
    onehot = ((cols == target) & inside).float()
    return ((onehot - softmax) * (grad * inv_t)).to(x.dtype)


@cuda_compiled
def _grad_many(
    x: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    inside: torch.Tensor,
    grad: torch.Tensor,
    inv_t: float,
) -> torch.Tensor:
    """k ids per row: sum_j grad_j (onehot(target_j) - softmax) / T."""
    softmax = torch.exp(wide(x) * inv_t - lse[:, None])
    out = -softmax * (grad.sum(-1, keepdim=True) * inv_t)
    out = out.scatter_add(-1, target, torch.where(inside, grad * inv_t, torch.zeros_like(grad)))
    return out.to(x.dtype)


@cuda_compiled
def _grad_entropy(
    x: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, grad: torch.Tensor, inv_t: float
) -> torch.Tensor:
    """dH/dx = -p (log p + H) / T, times the incoming grad."""
    logp = wide(x) * inv_t - lse[:, None]
    p = torch.exp(logp)
    return (-p * (logp + entropy[:, None]) * (grad * inv_t)[:, None]).to(x.dtype)


ChunkGrad = Callable[[int, int, torch.Tensor], torch.Tensor]
"""(first row, end row, the chunk's logits) -> the gradient for those logits."""


def spans(n: int, chunk: int | None) -> list[tuple[int, int]]:
    """Row ranges of the chunks (one, possibly empty, range when unchunked)."""
    if chunk is None or chunk >= n:
        return [(0, n)]
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor | None, cols: int) -> torch.Tensor:
    """One chunk's logits, the real vocabulary columns only."""
    if weight is None:
        return hidden[:, :cols]
    return F.linear(hidden, weight[:cols])


def all_reduce(
    t: torch.Tensor, group: dist.ProcessGroup | None, op: Any = dist.ReduceOp.SUM
) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


@dataclass(frozen=True, slots=True)
class _Picks:
    """What a chunk's backward needs besides its logits."""

    lse: torch.Tensor  # [n] log-normalizer of logits / T
    entropy: torch.Tensor | None  # [n]
    local: torch.Tensor  # [n, k] ids as this rank's columns (clamped)
    inside: torch.Tensor  # [n, k] whether this rank owns the id


def _grad_chunk(
    x: torch.Tensor,
    p: _Picks,
    grad_lp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    inv_t: float,
) -> torch.Tensor:
    """d/dx of sum_j grad_lp_j * lp_j + grad_ent * H for one chunk's logits x."""
    out = None
    if grad_lp is not None and grad_lp.shape[-1] > 0:
        kernel = _grad_one if grad_lp.shape[-1] == 1 else _grad_many
        out = kernel(x, p.lse, p.local, p.inside, grad_lp, inv_t)
    if grad_ent is not None:
        assert p.entropy is not None
        g = _grad_entropy(x, p.lse, p.entropy, grad_ent, inv_t)
        out = g if out is None else out + g
    return torch.zeros_like(x) if out is None else out


class _ChunkedStats(torch.autograd.Function):
    """(lp [N, k], entropy [N] or None) of softmax(hidden @ weight.T / T) at global ids `target`,
    chunk by chunk; see the module docstring. `cols`: this rank's real vocabulary columns, the
    first of which is id `start`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor | None,
        target: torch.Tensor,
        opts: LogitOptions,
        cols: int,
        start: int,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.set_materialize_grads(False)
        inv_t = 1.0 / opts.temperature
        local = target - start
        inside = (local >= 0) & (local < cols)
        local = local.clamp(0, max(cols - 1, 0))
        n = hidden.shape[0]
        parts = spans(n, opts.chunk_tokens)
        lse = hidden.new_empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32))
        lp = lse.new_empty(target.shape)
        entropy = lse.new_empty(n) if want_entropy else None
        kept = None
        for a, b in parts:
            x = chunk_logits(hidden[a:b], weight, cols)
            if target.shape[-1]:
                row_max, picked = _max_and_picked(x, local[a:b], inside[a:b], inv_t)
                all_reduce(picked, opts.tp_group)
            else:  # the entropy alone: no ids to pick (and no empty gather to compile)
                row_max, picked = (wide(x.amax(-1)) * inv_t).contiguous(), lp[a:b]
            all_reduce(row_max, opts.tp_group, dist.ReduceOp.MAX)
            sums = (_exp_sums if want_entropy else sum_exp)(x, row_max, inv_t)
            all_reduce(sums, opts.tp_group)
            lse[a:b] = row_max + sums[0].log()
            lp[a:b] = picked - lse[a:b, None]
            if entropy is not None:
                entropy[a:b] = sums[0].log() - sums[1] / sums[0]
            # one chunk: keep its logits for the backward; several: each is recomputed there
            kept = x if len(parts) == 1 else None
        ctx.save_for_backward(hidden, weight, kept, lse, entropy, local, inside)
        ctx.opts, ctx.cols = opts, cols
        return lp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, kept, lse, entropy, local, inside = ctx.saved_tensors
        opts, cols = ctx.opts, ctx.cols

        def chunk_grad(a: int, b: int, x: torch.Tensor) -> torch.Tensor:
            picks = _Picks(
                lse[a:b], None if entropy is None else entropy[a:b], local[a:b], inside[a:b]
            )
            return _grad_chunk(
                x,
                picks,
                None if grad_lp is None else grad_lp[a:b].contiguous(),
                None if grad_ent is None else grad_ent[a:b].contiguous(),
                1.0 / opts.temperature,
            )

        grads = head_grads(hidden, weight, kept, cols, opts.chunk_tokens, ctx.needs_input_grad)
        return (*grads(chunk_grad), None, None, None, None, None)


def head_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    kept: torch.Tensor | None,
    cols: int,
    chunk_tokens: int | None,
    needs: tuple[bool, ...],
) -> Callable[[ChunkGrad], tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The backward of a chunked pass over `hidden @ weight.T` (`kept`: the logits of a single
    chunk, else each chunk's are recomputed): given each chunk's gradient for its logits
    (`chunk_grad(a, b, logits)`), the gradients (hidden, weight) as `needs` asks."""

    def run(chunk_grad: ChunkGrad) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        want_h, want_w = needs[:2]
        grad_h = torch.zeros_like(hidden) if want_h else None
        parts = spans(hidden.shape[0], chunk_tokens)
        grad_w = None
        if want_w:  # [V/tp, H]; the chunks' parts add up in fp32, one chunk's is one matmul
            assert weight is not None
            acc = weight.dtype if len(parts) == 1 else torch.float32
            grad_w = weight.new_zeros(weight.shape, dtype=torch.promote_types(acc, weight.dtype))
        for a, b in parts:
            x = kept if kept is not None else chunk_logits(hidden[a:b], weight, cols)
            gx = chunk_grad(a, b, x)
            if weight is None:  # `hidden` are the logits
                if grad_h is not None:
                    grad_h[a:b, :cols] = gx
                continue
            if grad_h is not None:
                grad_h[a:b] = gx @ weight[:cols]
            if grad_w is not None:
                grad_w[:cols] += gx.t() @ hidden[a:b]
        if grad_w is not None:
            assert weight is not None
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w

    return run


def vocab_part(head: Head, opts: LogitOptions) -> tuple[int, int]:
    """(this rank's real vocabulary columns, the global id of its first column). The output
    layer pads the vocabulary to a multiple of TP; padded columns never count."""
    start = opts.tp_rank * head.part
    if opts.vocab_size is None:
        return head.part, start
    return max(0, min(head.part, opts.vocab_size - start)), start


def logprobs_at(
    head: Head, ids: torch.Tensor, opts: LogitOptions, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`log softmax(logits / T)` at global vocabulary ids `ids` [B, S, k], and with `entropy`
    the entropy [B, S]) at each position, unshifted, fp32, differentiable. Each TP rank gathers
    the ids it owns; only the log-normalizer and the picked values cross ranks."""
    b, s, _ = head.hidden.shape
    k = ids.shape[-1]
    cols, start = vocab_part(head, opts)
    lp, ent = _ChunkedStats.apply(
        head.hidden.reshape(b * s, -1),
        head.weight,
        ids.reshape(b * s, k),
        opts,
        cols,
        start,
        entropy,
    )
    return lp.reshape(b, s, k), None if ent is None else ent.reshape(b, s)


def topk(head: Head, k: int, opts: LogitOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k `(values, indices)` [B, S, k] of `logits / temperature` over the full
    vocabulary, chunk by chunk: each rank keeps its local top-k of each chunk, the candidates are
    all-gathered once, and the top-k of those wins. Position i holds the distribution of token
    i+1 (the logits at i)."""
    b, s, _ = head.hidden.shape
    hidden = head.hidden.reshape(b * s, -1)
    cols, start = vocab_part(head, opts)
    # Every rank offers the same number of candidates (all_gather wants equal shapes); a rank
    # with fewer real columns than that offers -inf for the rest.
    local_k, taken = min(k, head.part), min(k, cols)
    vals = hidden.new_full((b * s, local_k), float("-inf"), dtype=torch.float32)
    idx = torch.zeros((b * s, local_k), dtype=torch.int64, device=hidden.device)
    with torch.no_grad():
        for a, e in spans(b * s, opts.chunk_tokens):
            x = chunk_logits(hidden[a:e], head.weight, cols)
            v, i = (x.float() / opts.temperature).topk(taken, dim=-1)
            vals[a:e, :taken], idx[a:e, :taken] = v, i + start
    world = 1 if opts.tp_group is None else dist.get_world_size(opts.tp_group)
    if world > 1:
        all_vals = [torch.empty_like(vals) for _ in range(world)]
        all_idx = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(all_vals, vals, group=opts.tp_group)
        dist.all_gather(all_idx, idx, group=opts.tp_group)
        vals, idx = torch.cat(all_vals, dim=-1), torch.cat(all_idx, dim=-1)
    if k > vals.shape[-1]:
        raise ValueError(f"k={k} is larger than the vocabulary ({vals.shape[-1]})")
    top, pos = vals.topk(k, dim=-1)
    return top.reshape(b, s, k), idx.gather(-1, pos).reshape(b, s, k)


def full_logits(head: Head, opts: LogitOptions) -> torch.Tensor:
    """[B, S, V] logits of the whole true vocabulary (no temperature), gathered over TP: what a
    full-vocabulary distillation payload carries. Materializes the micro-batch's logits."""
    x = head.hidden if head.weight is None else F.linear(head.hidden, head.weight)
    world = 1 if opts.tp_group is None else dist.get_world_size(opts.tp_group)
    if world > 1:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=opts.tp_group)
        x = torch.cat(parts, dim=-1)
    return x if opts.vocab_size is None else x[..., : opts.vocab_size]
