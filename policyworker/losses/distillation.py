"""Distillation: from a teacher's top-k logits (NeMo-RL's `DistillationLossFn` semantics), and from
its whole vocabulary (`FullDistillationLoss`, at the end).

The batch carries the teacher's `teacher_topk_logits` and `teacher_topk_indices` [B, S, k], as the
teacher worker's `get_topk_logits` returns them: position i holds the top-k of the distribution
of token i+1. The student's logprobs at those ids come from its vocab-parallel logits (each TP
rank gathers the ids it owns and the log-normalizer is reduced over TP; no [B, S, V] fp32 copy).
Positions 0..S-2 are compared, masked by `token_mask[:, 1:] * sample_mask`.

- `zero_outside_topk=False` (default): both sides are renormalized over the k ids, and the KL is
  taken over those k ids only.
- `zero_outside_topk=True`: the student keeps its full-vocabulary probabilities; the teacher puts
  (almost) no mass outside its top-k, log p = -100 there. The forward KL gets no term from outside
  the top-k (the teacher has no mass there); reverse and mixed KL add the student's outside mass:
  `H_rest - (-100) * P_rest` with `H_rest = sum_outside p log p`, `P_rest` its mass.

    forward = sum_k p_t (log p_t - log p_s);  reverse = sum_k p_s (log p_s - log p_t)
    mixed   = w * forward + (1 - w) * reverse
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from policyworker.losses.common import Loss, LossInputs, LossNeeds, TokenView, masked_mean
from policyworker.schema import build, refuse_non_finite

LOG_INFINITESIMAL = -100.0
"""The teacher's log-probability outside its top-k with `zero_outside_topk` (as the reference)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DistillationConfig:
    """Options of `DistillationLoss`, named as NeMo-RL's `DistillationLossConfig`."""

    kl_type: Literal["forward", "reverse", "mixed"] = "mixed"
    """KL(teacher || student), KL(student || teacher), or their mix."""
    mixed_kl_weight: float = 0.5
    """w: weight of the forward KL in the mix."""
    zero_outside_topk: bool = False
    """Keep the student's full-vocabulary probabilities (and its mass outside the top-k)."""

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        if self.kl_type not in ("forward", "reverse", "mixed"):
            raise ValueError(f"kl_type: expected forward/reverse/mixed, got {self.kl_type!r}")
        if not 0 <= self.mixed_kl_weight <= 1:
            raise ValueError(f"mixed_kl_weight: expected in [0, 1], got {self.mixed_kl_weight}")


class DistillationLoss(Loss):
    """Top-k KL of the student to the teacher; see the module docstring."""

    required_keys = ("token_mask", "sample_mask", "teacher_topk_logits", "teacher_topk_indices")

    def __init__(self, cfg: DistillationConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg = build(DistillationConfig, cfg)
        self.outside_mass = cfg.zero_outside_topk and cfg.kl_type != "forward"
        self.needs = LossNeeds(
            logprobs=False, entropy=self.outside_mass, index_key="teacher_topk_indices"
        )

    def __call__(
        self,
        inputs: LossInputs,
        data: Mapping[str, torch.Tensor],
        counts: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        assert inputs.index_logprobs is not None
        student = inputs.index_logprobs[:, :-1]  # [B, S-1, k], full-vocabulary normalized
        if not cfg.zero_outside_topk:
            student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = torch.log_softmax(data["teacher_topk_logits"][:, :-1].to(student.dtype), dim=-1)
        p_s, p_t = student.exp(), teacher.exp()
        w = {"forward": 1.0, "reverse": 0.0, "mixed": cfg.mixed_kl_weight}[cfg.kl_type]
        per_token = student.new_zeros(student.shape[:-1])  # [B, S-1]
        if w > 0:
            per_token = per_token + w * (p_t * (teacher - student)).sum(-1)
        if w < 1:
            per_token = per_token + (1 - w) * (p_s * (student - teacher)).sum(-1)
        if self.outside_mass:
            assert inputs.entropy is not None
            h_rest = -inputs.entropy[:, :-1] - (p_s * student).sum(-1)  # sum_outside p log p
            p_rest = 1 - p_s.sum(-1)
            per_token = per_token + (1 - w) * (h_rest - LOG_INFINITESIMAL * p_rest)
        view = TokenView.of(data)
        loss = masked_mean(per_token, view.mask, counts["global_valid_toks"])
        return loss, {"loss": loss.detach(), "num_valid_samples": view.sample_mask.sum()}


PAYLOAD_KINDS = ("hidden_states", "logits")


@dataclass(kw_only=True, slots=True, frozen=True)
class FullDistillationConfig:
    """Options of `FullDistillationLoss` (full-vocabulary on-policy distillation, "opd_full")."""

    payload: Literal["hidden_states", "logits"] = "hidden_states"
    """What the batch's `teacher_full_payload` [B, S, D] holds: the teacher's final hidden states
    (the student multiplies them by the teacher's LM head, `load_opd_full_teacher_lm_head`) or
    its full-vocabulary logits."""
    kl_coef: float = 1.0
    """Weight of the KL in the loss."""

    def __post_init__(self) -> None:
        if self.payload not in PAYLOAD_KINDS:
            raise ValueError(f"payload: expected one of {PAYLOAD_KINDS}, got {self.payload!r}")
        if not (isinstance(self.kl_coef, int | float) and 0 < self.kl_coef < float("inf")):
            raise ValueError(f"kl_coef: expected a finite number > 0, got {self.kl_coef!r}")


class FullDistillationLoss(Loss):
    """`kl_coef` times the full-vocabulary reverse KL of the student to the teacher, per token:

        loss = kl_coef * sum_i mask_i * KL(p_s(. | x_<=i) || p_t(. | x_<=i)) / global_valid_toks

    over positions 0..S-2 masked by `token_mask[:, 1:] * sample_mask` (the distributions of the
    tokens that have a logprob), both distributions at the worker's temperature. The KL is
    computed vocab-parallel and chunked along the sequence (`ops.kl`): no full-vocabulary fp32
    tensor. The batch carries `teacher_full_payload` as the teacher's
    `get_logprobs_with_full_payload` returns it (rows may be on CPU; each micro-batch's move to
    the device when it runs) and, when more than one teacher head is loaded, `teacher_index` [B].
    """

    required_keys = ("token_mask", "sample_mask", "teacher_full_payload")

    def __init__(self, cfg: FullDistillationConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg = build(FullDistillationConfig, cfg)
        self.needs = LossNeeds(logprobs=False, teacher_payload=cfg.payload)

    def __call__(
        self,
        inputs: LossInputs,
        data: Mapping[str, torch.Tensor],
        counts: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert inputs.reverse_kl is not None
        view = TokenView.of(data)
        kl = masked_mean(inputs.reverse_kl[:, :-1], view.mask, counts["global_valid_toks"])
        loss = self.cfg.kl_coef * kl
        metrics = {"loss": loss.detach(), "reverse_kl": kl.detach()}
        return loss, metrics | {"num_valid_samples": view.sample_mask.sum()}
