"""Negative log-likelihood (SFT)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from policyworker.losses.common import Loss, LossInputs, TokenView, masked_mean


class NLLLoss(Loss):
    """`-masked_mean(logprobs, token_mask * sample_mask, global_valid_toks)`.

    Metrics: `loss`, `num_unmasked_tokens` (tokens the loss covers), `num_valid_samples`.
    """

    def __call__(
        self,
        inputs: LossInputs,
        data: Mapping[str, torch.Tensor],
        counts: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert inputs.logprobs is not None
        view = TokenView.of(data)
        loss = -masked_mean(inputs.logprobs[:, 1:], view.mask, counts["global_valid_toks"])
        return loss, {
            "loss": loss.detach(),
            "num_unmasked_tokens": view.mask.sum(),
            "num_valid_samples": view.sample_mask.sum(),
        }
