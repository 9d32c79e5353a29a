"""What every loss shares: the call signature, masked means, the per-token view of a batch.

A loss is a pure function of tensors. It returns a scalar that is already normalized by the
*global* counts (summed over every micro-batch and data-parallel rank), so summing it over
micro-batches and ranks gives the global loss, and the gradient does not depend on how the batch
was cut. Metrics follow the same rule: each is a sum normalized by a global count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

EPS = 1e-8


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, denom: torch.Tensor | float
) -> torch.Tensor:
    """`sum(values * mask) / (denom + 1e-8)`: a mean whose denominator is given, not counted."""
    return (values * mask).sum() / (denom + EPS)


@dataclass(frozen=True, slots=True)
class TokenView:
    """The loss-relevant slice of a micro-batch: positions 1: (the ones that have a logprob)."""

    mask: torch.Tensor  # [B, S-1] token_mask * sample_mask
    sample_mask: torch.Tensor  # [B]

    @classmethod
    def of(cls, data: Mapping[str, torch.Tensor]) -> TokenView:
        sample_mask = data["sample_mask"].float()
        mask = data["token_mask"][:, 1:].float() * sample_mask[:, None]
        return cls(mask=mask, sample_mask=sample_mask)


def global_counts(data: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid sequences, valid tokens) of a batch, before any all-reduce."""
    view = TokenView.of(data)
    return view.sample_mask.sum(), view.mask.sum()


class LossFunction(Protocol):
    """`loss(logprobs, data, ...) -> (loss, metrics)`; see the module docstring for normalization."""

    required_keys: tuple[str, ...]
    """Batch fields the loss reads, beyond input_ids/input_lengths."""
    needs_entropy: bool
    """Whether the train step should compute the policy entropy [B, S] for the metrics."""

    def prepare_batch(self, data: Any) -> Any:
        """Adjust a whole global batch before counts are taken (e.g. drop sequences)."""
        ...

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        *,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...
