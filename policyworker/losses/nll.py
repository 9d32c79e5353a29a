"""Negative log-likelihood (SFT)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from policyworker.losses.common import TokenView, masked_mean


class NLLLoss:
    """`-masked_mean(logprobs, token_mask * sample_mask, global_valid_toks)`."""

    required_keys: tuple[str, ...] = ("token_mask", "sample_mask")
    needs_entropy = False

    def prepare_batch(self, data: Any) -> Any:
        return data

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        *,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        view = TokenView.of(data)
        loss = -masked_mean(logprobs[:, 1:], view.mask, global_valid_toks)
        return loss, {"loss": loss.detach()}
