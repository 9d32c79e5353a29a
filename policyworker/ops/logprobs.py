"""Token logprobs, top-k and entropy from vocab-parallel logits.

Logits arrive as megatron's output layer leaves them: `[B, S, V/tp]`, this TP rank's slice of the
vocabulary. The logit passes are `cuda_compiled`: on GPU each is one fused kernel reading the
(bf16) logits once, with no fp32 [B, S, V] copy. Everything here is exact under any TP size: the
log-softmax reduces the row max (all-reduce MAX), the sum of exp and the picked logits (all-reduce
SUM) over the TP group, and every backward is local, e.g. `(onehot - softmax) / temperature` on
each rank's slice. Top-k gathers the per-rank candidates.

Alignment (docs/semantics.md): `logprobs[:, i] = log p(ids[:, i] | ids[:, :i])`, position 0 is 0;
entropy, top-k and index logprobs at i describe the distribution of token i+1 (the logits at i).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from policyworker.ops.compiled import cuda_compiled


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32 for bf16/fp32 logits, fp64 for fp64 (exact tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@cuda_compiled
def _max_and_picked(
    x: torch.Tensor, target: torch.Tensor, inside: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max [N] and the logits at `target` [N, k] (0 where this rank does not own the id)."""
    x32 = _wide(x) * inv_t
    picked = x32.gather(-1, target)
    return x32.amax(-1), torch.where(inside, picked, torch.zeros_like(picked))


@cuda_compiled
def _sum_exp(x: torch.Tensor, row_max: torch.Tensor, inv_t: float) -> torch.Tensor:
    return torch.exp(_wide(x) * inv_t - row_max[:, None]).sum(-1)


@cuda_compiled
def _grad_logits_one(
    x: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    inside: torch.Tensor,
    grad: torch.Tensor,
    inv_t: float,
) -> torch.Tensor:
    """k = 1 (token logprobs): (onehot(target) - softmax) / T times the incoming grad, one pass."""
    softmax = torch.exp(_wide(x) * inv_t - lse[:, None])
    cols = torch.arange(x.shape[-1], device=x.device)[None, :]
    onehot = ((cols == target) & inside).float()
    return ((onehot - softmax) * (grad * inv_t)).to(x.dtype)


@cuda_compiled
def _grad_logits_many(
    x: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    inside: torch.Tensor,
    grad: torch.Tensor,
    inv_t: float,
) -> torch.Tensor:
    """k ids per row: sum_j grad_j (onehot(target_j) - softmax) / T."""
    softmax = torch.exp(_wide(x) * inv_t - lse[:, None])
    out = -softmax * (grad.sum(-1, keepdim=True) * inv_t)
    out = out.scatter_add(-1, target, torch.where(inside, grad * inv_t, torch.zeros_like(grad)))
    return out.to(x.dtype)


class _IndexLogprobs(torch.autograd.Function):
    """lp[n, j] = x[n, target[n, j]] / T - logsumexp(x[n] / T), x vocab-parallel [N, V/tp] whose
    first column is vocabulary id `vocab_start`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        target: torch.Tensor,
        inv_t: float,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int,
    ) -> torch.Tensor:
        part = x.shape[-1]
        local = target - vocab_start
        inside = (local >= 0) & (local < part)
        local = local.clamp(0, part - 1)
        row_max, picked = _max_and_picked(x, local, inside, inv_t)
        parallel = tp_group is not None and dist.get_world_size(tp_group) > 1
        if parallel:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
            dist.all_reduce(picked, group=tp_group)
        total = _sum_exp(x, row_max, inv_t)
        if parallel:
            dist.all_reduce(total, group=tp_group)
        lse = row_max + total.log()
        ctx.save_for_backward(x, lse, local, inside)
        ctx.inv_t = inv_t
        return picked - lse[:, None]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, lse, local, inside = ctx.saved_tensors
        kernel = _grad_logits_one if local.shape[-1] == 1 else _grad_logits_many
        grad_x = kernel(x, lse, local, inside, grad.contiguous(), ctx.inv_t)
        return grad_x, None, None, None, None


def vocab_slice(
    logits: torch.Tensor, tp_rank: int, vocab_size: int | None
) -> tuple[torch.Tensor, int]:
    """(this rank's columns that are real vocabulary, the id of its first column). The output
    layer has the vocabulary padded to a multiple of TP; padded columns never count."""
    part = logits.shape[-1]
    start = tp_rank * part
    if vocab_size is not None and start + part > vocab_size:
        logits = logits[..., : vocab_size - start]
    return logits, start


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    tp_rank: int,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """fp32 logprobs [B, S] of `input_ids` under `logits / temperature` [B, S, V/tp]; differentiable.

    Runs over all S positions (the last one's target is a dummy and its value is dropped), so the
    logits need no slicing and their gradient no scatter back into a padded tensor.
    """
    b, s, _ = logits.shape
    x, start = vocab_slice(logits, tp_rank, vocab_size)
    targets = torch.cat([input_ids[:, 1:], input_ids.new_zeros(b, 1)], dim=1)  # next token
    lp = _IndexLogprobs.apply(
        x.reshape(b * s, -1), targets.reshape(-1, 1), 1.0 / temperature, tp_group, start
    ).reshape(b, s)
    return torch.cat([lp.new_zeros(b, 1), lp[:, :-1]], dim=1)


def index_logprobs(
    logits: torch.Tensor,
    indices: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    tp_rank: int,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """fp32 `log softmax(logits / T)` at vocabulary ids `indices` [B, S, k] (global ids), per
    position and unshifted; differentiable. Each TP rank gathers the ids it owns; only the
    log-normalizer and the gathered values cross ranks, never a [B, S, V] tensor."""
    b, s, _ = logits.shape
    k = indices.shape[-1]
    x, start = vocab_slice(logits, tp_rank, vocab_size)
    return _IndexLogprobs.apply(
        x.reshape(b * s, -1), indices.reshape(-1, k), 1.0 / temperature, tp_group, start
    ).reshape(b, s, k)


@cuda_compiled
def _entropy_sums(x: torch.Tensor, row_max: torch.Tensor, inv_t: float) -> torch.Tensor:
    """[2, N]: sum(e) and sum(e * y) with y = x / T - max, e = exp(y)."""
    y = _wide(x) * inv_t - row_max[:, None]
    e = torch.exp(y)
    return torch.stack([e.sum(-1), (e * y).sum(-1)])


@cuda_compiled
def _entropy_grad(
    x: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, grad: torch.Tensor, inv_t: float
) -> torch.Tensor:
    """dH/dx = -p (log p + H) / T, times the incoming grad."""
    logp = _wide(x) * inv_t - lse[:, None]
    p = torch.exp(logp)
    return (-p * (logp + entropy[:, None]) * (grad * inv_t)[:, None]).to(x.dtype)


class _Entropy(torch.autograd.Function):
    """H[n] = -sum_v p log p of softmax(x[n] / T), x vocab-parallel [N, V/tp]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, inv_t: float, tp_group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        parallel = tp_group is not None and dist.get_world_size(tp_group) > 1
        row_max = (_wide(x.amax(-1)) * inv_t).contiguous()
        if parallel:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        sums = _entropy_sums(x, row_max, inv_t)
        if parallel:
            dist.all_reduce(sums, group=tp_group)
        z, ey = sums
        entropy = z.log() - ey / z
        ctx.save_for_backward(x, row_max + z.log(), entropy)
        ctx.inv_t = inv_t
        return entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, lse, entropy = ctx.saved_tensors
        return _entropy_grad(x, lse, entropy, grad.contiguous(), ctx.inv_t), None, None


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    tp_rank: int = 0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Entropy [B, S] of softmax(logits / temperature) at every position; differentiable."""
    b, s, _ = logits.shape
    x, _ = vocab_slice(logits, tp_rank, vocab_size)
    return _Entropy.apply(x.reshape(b * s, -1), 1.0 / temperature, tp_group).reshape(b, s)


def topk_logits(
    logits: torch.Tensor,
    k: int,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    tp_rank: int,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k `(values, indices)` [B, S, k] of `logits / temperature` over the full vocabulary.

    Each rank takes its local top-k, the candidates are all-gathered, and the top-k of those wins.
    Position i holds the distribution for token i+1 (the logits at i), unshifted.
    """
    x, start = vocab_slice(logits, tp_rank, vocab_size)
    # Every rank offers the same number of candidates (all_gather wants equal shapes); a rank
    # with fewer real columns than that offers -inf for the rest.
    local_k = min(k, logits.shape[-1])
    vals, idx = (x.float() / temperature).topk(min(local_k, x.shape[-1]), dim=-1)
    if vals.shape[-1] < local_k:
        missing = local_k - vals.shape[-1]
        vals = torch.cat([vals, vals.new_full((*vals.shape[:-1], missing), float("-inf"))], -1)
        idx = torch.cat([idx, idx.new_zeros((*idx.shape[:-1], missing))], -1)
    idx = idx + start  # global vocabulary ids
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    if world > 1:
        all_vals = [torch.empty_like(vals) for _ in range(world)]
        all_idx = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_idx, idx.contiguous(), group=tp_group)
        vals, idx = torch.cat(all_vals, dim=-1), torch.cat(all_idx, dim=-1)
    if k > vals.shape[-1]:
        raise ValueError(f"k={k} is larger than the vocabulary ({vals.shape[-1]})")
    top, pos = vals.topk(k, dim=-1)
    return top, idx.gather(-1, pos)
