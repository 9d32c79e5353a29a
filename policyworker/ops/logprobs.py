"""Token logprobs, top-k and entropy from vocab-parallel logits.

Logits arrive as megatron's output layer leaves them: `[B, S, V/tp]`, this TP rank's slice of the
vocabulary. Everything here is exact under any TP size: the log-softmax uses megatron's
`vocab_parallel_cross_entropy` (all-reduce MAX, then SUM of exp; local backward), top-k gathers the
per-rank candidates.

Alignment (REFERENCE.md): `logprobs[:, i] = log p(ids[:, i] | ids[:, :i])`, position 0 is 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """fp32 logprobs [B, S] of `input_ids` under `logits / temperature` [B, S, V/tp].

    Differentiable; megatron's kernel takes any leading dims, so no transpose is needed.
    """
    # A fresh fp32 copy: megatron's kernel consumes its input in place; `logits` stays intact.
    scaled = logits[:, :-1].to(torch.float32, copy=True).contiguous()  # [B, S-1, V/tp]
    if temperature != 1.0:
        scaled.div_(temperature)
    nll = vocab_parallel_cross_entropy(scaled, input_ids[:, 1:].contiguous(), tp_group=tp_group)
    lp = -nll  # [B, S-1]
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


def _max_and_target(
    x: torch.Tensor, target: torch.Tensor, inside: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float() * inv_t
    picked = x32.gather(-1, target[:, None]).squeeze(-1)
    return x32.amax(-1), torch.where(inside, picked, torch.zeros_like(picked))


def _sum_exp(x: torch.Tensor, row_max: torch.Tensor, inv_t: float) -> torch.Tensor:
    return torch.exp(x.float() * inv_t - row_max[:, None]).sum(-1)


# On GPU each pass is one fused kernel reading the bf16 logits once: no fp32 copy of [B, S, V].
_fused_max_and_target = torch.compile(_max_and_target, dynamic=True)
_fused_sum_exp = torch.compile(_sum_exp, dynamic=True)


@torch.no_grad()
def token_logprobs_no_grad(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    tp_rank: int,
) -> torch.Tensor:
    """`token_logprobs` for inference: same math (max, sum of exp, target logit, each reduced over
    TP), without autograd state or a materialized fp32 copy of the logits."""
    b, s, part = logits.shape
    x = logits[:, :-1].reshape(-1, part)  # [N, V/tp]
    local = input_ids[:, 1:].reshape(-1) - tp_rank * part
    inside = (local >= 0) & (local < part)
    local = local.clamp(0, part - 1)
    fused = x.is_cuda
    max_and_target = _fused_max_and_target if fused else _max_and_target
    sum_exp = _fused_sum_exp if fused else _sum_exp
    inv_t = 1.0 / temperature
    row_max, picked = max_and_target(x, local, inside, inv_t)
    parallel = tp_group is not None and dist.get_world_size(tp_group) > 1
    if parallel:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        dist.all_reduce(picked, group=tp_group)
    total = sum_exp(x, row_max, inv_t)
    if parallel:
        dist.all_reduce(total, group=tp_group)
    lp = (picked - row_max - total.log()).reshape(b, s - 1)
    return torch.cat([lp.new_zeros(b, 1), lp], dim=1)


def vocab_parallel_entropy(
    logits: torch.Tensor, *, temperature: float, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Entropy [B, S] of softmax(logits / temperature) at every position (no grad; a metric)."""
    with torch.no_grad():
        x = logits.float() / temperature
        local_max = x.max(dim=-1).values
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
        x = x - local_max.unsqueeze(-1)
        e = x.exp()
        sums = torch.stack([e.sum(-1), (e * x).sum(-1)])  # [2, B, S]
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(sums, group=tp_group)
        z, ex = sums
        return z.log() - ex / z


def topk_logits(
    logits: torch.Tensor,
    k: int,
    *,
    temperature: float,
    tp_group: dist.ProcessGroup | None,
    tp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k `(values, indices)` [B, S, k] of `logits / temperature` over the full vocabulary.

    Each rank takes its local top-k, the candidates are all-gathered, and the top-k of those wins.
    Position i holds the distribution for token i+1 (the logits at i), unshifted.
    """
    part = logits.shape[-1]
    local_k = min(k, part)
    vals, idx = (logits.float() / temperature).topk(local_k, dim=-1)
    idx = idx + tp_rank * part  # global vocabulary ids
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
