"""How an MoE family's router turns its logits into the top-k experts and their weights — a small
type per rule, read from the HF config once (`MoEShape.rule`):

* `Softmax` (Mixtral, Qwen2/3-MoE): a softmax over the experts, the top k; renormalized over
  those k (`normalize`) or not.
* `Sigmoid` (DeepSeek-V3, GLM-4.5): sigmoid scores; the experts are chosen on the scores plus a
  per-expert bias (`e_score_correction_bias`, the aux-loss-free balancing bias: it steers the
  choice, never the weights), within the best `group_topk` of `groups` groups of experts (a
  group ranked by the sum of its two best scores); the k weights renormalized and scaled.

megatron-core runs the rule (`megatron_fields`); where its group-limited choice differs from
HF's (it ranks a group by its best top-k / group-top-k scores, HF by its best two), our router
extension chooses (`choose`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""megatron's own choice: (scores, k, num_groups, group_topk) -> (values, indices)."""


@dataclass(frozen=True, slots=True)
class Softmax:
    """A softmax router; `normalize`: the top-k weights renormalized to sum to 1."""

    normalize: bool

    def megatron_fields(self) -> dict[str, Any]:
        # Renormalized, megatron softmaxes the k logits alone: the same numbers.
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not self.normalize)

    def choose(self, scores: torch.Tensor, k: int, default: TopK) -> tuple[torch.Tensor, ...]:
        return default(scores, k, None, None)

    def balance_probs(self, scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Every expert's probability for the load-balancing loss, from `choose`'s scores."""
        if not self.normalize:  # megatron's scores are the softmax over all experts already
            return scores
        return torch.softmax(scores, dim=-1, dtype=torch.float32)


@dataclass(frozen=True, slots=True)
class Sigmoid:
    """A sigmoid router with the expert bias (module docstring); `groups` 1: no groups."""

    groups: int
    group_topk: int
    scale: float

    def megatron_fields(self) -> dict[str, Any]:
        return dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=self.scale,
        )

    def choose(self, scores: torch.Tensor, k: int, default: TopK) -> tuple[torch.Tensor, ...]:
        """The top k of `scores` (biased: megatron's weights read the unbiased ones at these
        indices), within the best groups as HF ranks them."""
        if self.groups <= 1:
            return default(scores, k, None, None)
        tokens, experts = scores.shape
        grouped = scores.view(tokens, self.groups, experts // self.groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.group_topk, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        values, indices = scores.masked_fill(~keep, float("-inf")).topk(k, dim=-1, sorted=False)
        return values, indices

    def balance_probs(self, scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The sigmoid scores normalized over the experts (megatron's and DeepSeek-V3's balancing
        probabilities); `choose` was handed them plus the bias, taken off again here."""
        if bias is not None:
            scores = scores - bias.float()
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


RouterRule = Softmax | Sigmoid
