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
