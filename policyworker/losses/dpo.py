"""Direct Preference Optimization (DPO), with NeMo-RL's pairing and normalization.

Rows come in pairs: row 2i is the chosen response, row 2i+1 the rejected one, and a pair always
sits in one micro-batch (`rows_per_example = 2`). The implicit reward of a row is
`r = sum((curr - ref) * token_mask)` over positions 1: (divided by the token count with
`preference_average_log_probs`), and

    loss = w_pref * mean_pairs(-logsigmoid(beta * (r_chosen - r_rejected)))
         + w_sft  * mean_pairs(NLL of the chosen row)

where a pair's mean is over pairs whose chosen row has sample_mask 1, normalized by the global
pair count (global_valid_seqs / 2). `reference_policy_logprobs` is `get_reference_policy_logprobs`'s
output, aligned with input_ids like every per-token field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from policyworker.losses.common import Loss, LossInputs, TokenView, masked_mean
from policyworker.schema import build, refuse_non_finite


@dataclass(kw_only=True, slots=True, frozen=True)
class DPOConfig:
    """Options of `DPOLoss`, named as NeMo-RL's `DPOLossConfig`."""

    reference_policy_kl_penalty: float = 0.05
    """beta: scale of the reward margin inside the sigmoid."""
    preference_loss_weight: float = 1.0
    """w_pref: weight of the preference term."""
    sft_loss_weight: float = 0.0
    """w_sft: weight of the NLL of the chosen responses (0: off)."""
    preference_average_log_probs: bool = False
    """Average the reward over the row's tokens instead of summing."""
    sft_average_log_probs: bool = False
    """Average the chosen row's NLL over its tokens instead of summing."""

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        for name in ("reference_policy_kl_penalty", "preference_loss_weight", "sft_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")


class DPOLoss(Loss):
    """DPO on (chosen, rejected) row pairs; see the module docstring."""

    required_keys = ("token_mask", "sample_mask", "reference_policy_logprobs")
    rows_per_example = 2

    def __init__(self, cfg: DPOConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = build(DPOConfig, cfg)

    @property
    def normalizer(self) -> str | None:
        return "global_valid_seqs"  # every term divides by pairs = seqs / 2

    def __call__(
        self,
        inputs: LossInputs,
        data: Mapping[str, torch.Tensor],
        counts: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        assert inputs.logprobs is not None
        view = TokenView.of(data)
        curr = inputs.logprobs[:, 1:]
        pairs = counts["global_valid_seqs"] / 2
        chosen_mask, rejected_mask = view.sample_mask[::2], view.sample_mask[1::2]

        rewards = ((curr - data["reference_policy_logprobs"][:, 1:]) * view.token_mask).sum(-1)
        if cfg.preference_average_log_probs:
            rewards = rewards / view.token_mask.sum(-1).clamp(min=1)
        chosen, rejected = rewards[::2], rewards[1::2]
        per_pair = -F.logsigmoid(cfg.reference_policy_kl_penalty * (chosen - rejected))
        preference = masked_mean(per_pair * chosen_mask, chosen_mask, pairs)

        sft = curr.new_zeros(())
        if cfg.sft_loss_weight > 0:
            nll = -(curr * view.mask).sum(-1)  # [B]
            if cfg.sft_average_log_probs:
                nll = nll / view.mask.sum(-1).clamp(min=1)
            sft = masked_mean(nll[::2], chosen_mask, pairs)
        loss = cfg.sft_loss_weight * sft + cfg.preference_loss_weight * preference

        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "preference_loss": preference.detach(),
                "sft_loss": sft.detach(),
                "accuracy": masked_mean((chosen > rejected).float(), chosen_mask, pairs),
                "rewards_chosen_mean": masked_mean(chosen, chosen_mask, pairs),
                "rewards_rejected_mean": masked_mean(rejected, rejected_mask, pairs),
                "rewards_margin_mean": masked_mean(chosen - rejected, chosen_mask, pairs),
                "num_valid_samples": view.sample_mask.sum() / 2,
            }
        return loss, metrics
