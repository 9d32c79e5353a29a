"""Load-balancing losses of MoE routers, over segments of tokens: a micro-batch (`aux_loss`,
megatron's and the reference's definition) or each sequence (`seq_aux_loss`).

For a segment s of N_s real tokens, with c[s, e] the tokens routed to expert e (of E, K per
token) and p[t, e] the router's softmax over all experts,

    aux_s = coeff * E / (K * N_s^2) * sum_e c[s, e] * sum_{t in s} p[t, e]

and a step minimizes sum_s N_s * aux_s / G (G: the step's loss tokens, `global_valid_toks`, as
the main loss). Per sequence that sum does not depend on how sequences are cut into micro-batches,
packed, or spread over data-parallel ranks; per micro-batch it does, by definition. A rank holds
part of a segment under context and sequence parallelism: the counts are summed over the group
that shares it, and each rank's term covers its own tokens (their sum is the whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

BALANCE_TYPES = ("none", "aux_loss", "seq_aux_loss")


class Segmented(Protocol):
    """A micro-batch, as far as balancing needs it (`data.microbatch.Microbatch`)."""

    def segments(self, per_sequence: bool) -> tuple[torch.Tensor, int]: ...


class Balance(Protocol):
    """The load-balancing loss a model's routers add to a training forward (chosen once:
    `balance_of`)."""

    coeff: float
    adds_loss: ClassVar[bool]

    def segments(self, mb: Segmented) -> tuple[torch.Tensor, int] | None:
        """The micro-batch's segments [b, t] and their number (None: no loss)."""
        ...


@dataclass(frozen=True, slots=True)
class NoBalance:
    """No load-balancing loss."""

    coeff: float = 0.0
    adds_loss: ClassVar[bool] = False

    def segments(self, mb: Segmented) -> None:
        return None


@dataclass(frozen=True, slots=True)
class AuxLoss:
    """`aux_loss`: over each micro-batch's tokens (megatron's and the reference's)."""

    coeff: float
    adds_loss: ClassVar[bool] = True

    def segments(self, mb: Segmented) -> tuple[torch.Tensor, int]:
        return mb.segments(per_sequence=False)


@dataclass(frozen=True, slots=True)
class SeqAuxLoss:
    """`seq_aux_loss`: over each sequence's tokens (megatron's `seq_aux_loss` assumes [S, B]
    rows and would treat a packed bin as one sequence; this does not)."""

    coeff: float
    adds_loss: ClassVar[bool] = True

    def segments(self, mb: Segmented) -> tuple[torch.Tensor, int]:
        return mb.segments(per_sequence=True)


def balance_of(kind: str, coeff: float) -> Balance:
    """`moe.balance` (one of `BALANCE_TYPES`, checked by the config) as its type."""
    variants = {"none": NoBalance, "aux_loss": AuxLoss, "seq_aux_loss": SeqAuxLoss}
    return variants[kind](coeff) if kind != "none" else NoBalance()


def balance_term(
    probs: torch.Tensor,
    chosen: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    *,
    coeff: float,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """This rank's part of sum_s N_s * aux_s (see the module docstring), differentiable in
    `probs` [tokens, E]. `chosen` [tokens, K]: the experts each token went to; `segments`
    [tokens]: each token's segment in [0, num_segments), -1 for padding."""
    experts, topk = probs.shape[-1], chosen.shape[-1]
    real = segments >= 0
    seg = segments.clamp(min=0)
    counts = probs.new_zeros(num_segments, experts + 1)  # c[s, e] and N_s in the last column
    ones = real[:, None].expand_as(chosen).to(probs.dtype)
    counts.index_put_((seg[:, None].expand_as(chosen), chosen), ones, accumulate=True)
    counts[:, experts].index_add_(0, seg, real.to(probs.dtype))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    share = counts[:, :experts] / counts[:, experts : experts + 1].clamp_min(1)  # c / N
    return coeff * experts / topk * (share[seg] * probs * real[:, None]).sum()


class AttachLoss(torch.autograd.Function):
    """`x` unchanged; the backward also differentiates `loss` (with gradient 1): a loss term
    added inside the model, as megatron's MoEAuxLossAutoScaler, with the scale folded in."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)
