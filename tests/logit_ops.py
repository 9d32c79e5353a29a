"""The logit ops of `policyworker.ops.logprobs` on logits that exist already ([B, S, V/tp]):
what the tests compare against hand-computed values and the reference's code. The worker never
materializes logits this way (it passes a `Head`), so these live here, not in the package."""

from __future__ import annotations

from typing import Any

import torch

from policyworker.ops.logprobs import Head, LogitOptions, logprobs_at, topk


def index_logprobs(logits: torch.Tensor, indices: torch.Tensor, **tp: Any) -> torch.Tensor:
    """fp32 `log softmax(logits / T)` at vocabulary ids `indices` [B, S, k]; see `logprobs_at`.
    `tp`: the fields of `LogitOptions`."""
    return logprobs_at(Head.of_logits(logits), indices, LogitOptions(**tp))[0]


def vocab_parallel_entropy(logits: torch.Tensor, **tp: Any) -> torch.Tensor:
    """Entropy [B, S] of softmax(logits / temperature) at every position; differentiable."""
    empty = logits.new_zeros((*logits.shape[:2], 0), dtype=torch.int64)
    ent = logprobs_at(Head.of_logits(logits), empty, LogitOptions(**tp), entropy=True)[1]
    assert ent is not None
    return ent


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, **tp: Any) -> torch.Tensor:
    """fp32 logprobs [B, S] of `input_ids` (shifted: position 0 is 0); differentiable."""
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    lp = index_logprobs(logits, targets[..., None], **tp)[..., 0]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp[:, :-1]], dim=1)


def topk_logits(logits: torch.Tensor, k: int, **tp: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k `(values, indices)` [B, S, k] of `logits / temperature`; see `topk`."""
    return topk(Head.of_logits(logits), k, LogitOptions(**tp))
