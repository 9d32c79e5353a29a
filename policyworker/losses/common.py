"""What every loss shares: the inputs it asks for, the call, masked means, global counts.

A loss is a pure function of tensors. It returns a scalar that is already normalized by *global*
counts (summed over every micro-batch and data-parallel rank), so summing it over micro-batches
and ranks gives the global loss, and the gradient does not depend on how the batch was cut.
Metrics follow the same rule: each is a sum normalized by a global count, summed over
micro-batches and ranks by the train step — except metrics named `*_min` / `*_max`, which are
reduced by min / max.

Alignment: the logprob of token i sits at position i; a loss uses positions `1:` and masks them
with `token_mask[:, 1:] * sample_mask`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

EPS = 1e-8


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    denom: torch.Tensor | float | None = None,
    *,
    dim: int | None = None,
) -> torch.Tensor:
    """`sum(values * mask) / (denom + 1e-8)`; without `denom`, the mask's own sum (along `dim`)."""
    if dim is None:
        total = (values * mask).sum()
        return total / ((mask.sum() if denom is None else denom) + EPS)
    total = (values * mask).sum(dim)
    return total / ((mask.sum(dim) if denom is None else denom) + EPS)


@dataclass(frozen=True, slots=True)
class LossNeeds:
    """What a loss asks the train step to compute from each micro-batch's logits."""

    logprobs: bool = True
    """Token logprobs [B, S]."""
    entropy: bool = False
    """Entropy [B, S] of the distribution at each position (that of token i+1); differentiable."""
    index_key: str | None = None
    """Batch field of vocabulary ids [B, S, k]: their logprobs at each position, differentiable."""
    teacher_payload: str | None = None
    """"hidden_states" or "logits": the kind of the batch's `teacher_full_payload` [B, S, D],
    against which the full-vocabulary reverse KL is taken at each position (None: no KL)."""


@dataclass(frozen=True, slots=True)
class LossInputs:
    """What the train step computed for one micro-batch, as `LossNeeds` asked (else None)."""

    logprobs: torch.Tensor | None = None
    """[B, S] log p(token_i | tokens_<i); position 0 is 0."""
    entropy: torch.Tensor | None = None
    """[B, S] entropy of softmax(logits_i / T)."""
    index_logprobs: torch.Tensor | None = None
    """[B, S, k] log softmax(logits_i / T) at the ids `data[needs.index_key][:, i]`."""
    reverse_kl: torch.Tensor | None = None
    """[B, S] KL(student_i || teacher_i) over the whole vocabulary (the distributions of token
    i+1, both at temperature T); differentiable in the student."""


@dataclass(frozen=True, slots=True)
class TokenView:
    """The loss-relevant slice of a micro-batch: positions 1: (the ones that have a logprob)."""

    token_mask: torch.Tensor  # [B, S-1]
    sample_mask: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, S-1] token_mask * sample_mask

    @classmethod
    def of(cls, data: Mapping[str, torch.Tensor]) -> TokenView:
        sample_mask = _floating(data["sample_mask"])
        token_mask = _floating(data["token_mask"][:, 1:])
        return cls(
            token_mask=token_mask, sample_mask=sample_mask, mask=token_mask * sample_mask[:, None]
        )


def _floating(mask: torch.Tensor) -> torch.Tensor:
    """A mask as floats; a float64 mask stays float64 (the reference's goldens are in float64)."""
    return mask if mask.is_floating_point() else mask.float()


def valid_counts(data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`global_valid_seqs` and `global_valid_toks` of a batch, before summing over DP ranks."""
    view = TokenView.of(data)
    return {"global_valid_seqs": view.sample_mask.sum(), "global_valid_toks": view.mask.sum()}


class Loss:
    """Base of the losses: what a loss declares, with the common defaults.

    A subclass sets `needs` and `required_keys` and implements `__call__`; it may add global
    counts (`counts`), adjust the whole batch first (`prepare_batch`), or require rows to come in
    groups that stay in one micro-batch (`rows_per_example`, 2 for preference pairs).
    """

    needs: LossNeeds = LossNeeds()
    required_keys: tuple[str, ...] = ("token_mask", "sample_mask")
    """Batch fields the loss reads, beyond input_ids/input_lengths."""
    rows_per_example: int = 1

    @property
    def normalizer(self) -> str | None:
        """The count that divides every term of the loss, or None when terms divide by different
        counts. With one normalizer the gradient can be normalized after the fact, which is how a
        step runs when its global counts are not known up front (split-step training)."""
        return "global_valid_toks"

    def prepare_batch(self, data: Any) -> Any:
        """Adjust a whole (DP-local) global batch before counts are taken (e.g. drop sequences)."""
        return data

    def counts(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums over a batch that the step adds up over the global batch and all DP ranks."""
        return valid_counts(data)

    def __call__(
        self,
        inputs: LossInputs,
        data: Mapping[str, torch.Tensor],
        counts: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(globally normalized loss scalar, metrics) of one micro-batch."""
        raise NotImplementedError
