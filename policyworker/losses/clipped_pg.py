"""Clipped policy-gradient loss (PPO / GRPO and relatives), as REFERENCE.md specifies it.

Per token (positions 1:, masked by token_mask * sample_mask), with r = exp(curr - prev):

    actor = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))     (PPO surrogate)
          -> min(actor, -A * c) where A < 0                            (dual clip, c > 1)
          -> -A * curr                                                (disable_ppo_ratio)
          -> -A * sg(clip(r)) * curr                                  (CISPO)
    r     -> exp(masked mean of log r over the sequence)              (GSPO, sequence level)
    w     =  exp(prev - gen), NaN/inf -> 0, truncated by tis / icepop / seq-mask-tis
    kl    =  clamp(k(clamp(ref - curr, +-20)), +-10) * exp(curr - sg(curr)), k in k1/k2/k3
    total =  mean(w * actor) + beta * mean(w * kl) [+ coef * NLL on positive samples]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from policyworker.losses.common import TokenView, masked_mean


@dataclass(kw_only=True, slots=True, frozen=True)
class ClippedPGConfig:
    """Options of `ClippedPGLoss`; defaults are GRPO's."""

    ratio_clip_min: float = 0.2
    """eps_low: the ratio is clipped below at 1 - eps_low."""
    ratio_clip_max: float = 0.2
    """eps_high: the ratio is clipped above at 1 + eps_high."""
    ratio_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None: off)."""
    disable_ppo_ratio: bool = False
    """REINFORCE on the logprob: no ratio, no clipping."""
    force_on_policy_ratio: bool = False
    """Use prev := sg(curr), so r == 1 with the on-policy gradient."""
    cispo: bool = False
    """CISPO: -A * sg(clip(r)) * curr."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, the exp of its masked mean log-ratio."""
    use_importance_sampling_correction: bool = False
    """Weight tokens by exp(prev - gen) for trainer/generator mismatch."""
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """tis: clamp w to [min, max]; icepop: zero w outside; seq-mask-tis: mask whole sequences whose
    geometric-mean ratio is outside [min, max]."""
    truncated_importance_sampling_ratio_min: float = 0.0
    """Lower bound for the truncation."""
    truncated_importance_sampling_ratio_max: float = 2.0
    """Upper bound for the truncation."""
    reference_policy_kl_penalty: float = 0.01
    """beta: weight of the KL to the reference policy (0 disables it)."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_input_clamp_value: float = 20.0
    """Clamp of the log-ratio ref - curr before the estimator."""
    kl_output_clamp_value: float = 10.0
    """Clamp of the per-token KL estimate."""
    token_level_loss: bool = True
    """Mean over all tokens of the global batch (True) or per sequence, then over sequences."""
    positive_example_nll_coef: float | None = None
    """Add coef * NLL on samples with positive advantage (None: off)."""
    seq_logprob_error_threshold: float | None = None
    """Drop (sample_mask = 0) sequences whose mean exp(|gen - prev|) exceeds this (None: keep all)."""

    def __post_init__(self) -> None:
        for name in ("ratio_clip_min", "ratio_clip_max", "reference_policy_kl_penalty"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c: expected > 1 or None, got {self.ratio_clip_c}")
        if self.reference_policy_kl_type not in ("k1", "k2", "k3"):
            raise ValueError(
                f"reference_policy_kl_type: expected k1/k2/k3, got {self.reference_policy_kl_type!r}"
            )
        kinds = (None, "tis", "icepop", "seq-mask-tis")
        if self.truncated_importance_sampling_type not in kinds:
            raise ValueError(
                f"truncated_importance_sampling_type: expected one of {kinds}, "
                f"got {self.truncated_importance_sampling_type!r}"
            )
        if (
            self.truncated_importance_sampling_ratio_min
            > self.truncated_importance_sampling_ratio_max
        ):
            raise ValueError("truncated_importance_sampling_ratio_min: expected <= ratio_max")
        if self.disable_ppo_ratio and self.cispo:
            raise ValueError("cispo: cannot be combined with disable_ppo_ratio")


def _per_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def kl_estimate(curr: torch.Tensor, ref: torch.Tensor, cfg: ClippedPGConfig) -> torch.Tensor:
    """Per-token KL(curr || ref) estimate with both clamps and the score-function weight."""
    logr = (ref - curr).clamp(-cfg.kl_input_clamp_value, cfg.kl_input_clamp_value)
    if cfg.reference_policy_kl_type == "k1":
        kl = -logr
    elif cfg.reference_policy_kl_type == "k2":
        kl = logr.pow(2) / 2
    else:
        kl = logr.exp() - 1 - logr
    kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl * torch.exp(curr - curr.detach())


def importance_weights(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, cfg: ClippedPGConfig
) -> torch.Tensor:
    """w = exp(prev - gen) (NaN/inf -> 0), truncated as configured; [B, S-1], no grad."""
    w = torch.exp(prev - gen).detach()
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    lo, hi = (
        cfg.truncated_importance_sampling_ratio_min,
        cfg.truncated_importance_sampling_ratio_max,
    )
    kind = cfg.truncated_importance_sampling_type
    if kind == "tis":
        w = w.clamp(lo, hi)
    elif kind == "icepop":
        w = torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
    elif kind == "seq-mask-tis":
        geo = torch.exp(_per_sequence_mean(prev - gen, mask))  # [B]
        keep = ((geo >= lo) & (geo <= hi)).to(w.dtype)
        w = w * keep[:, None]
    return w


class ClippedPGLoss:
    """PPO/GRPO-family loss; see the module docstring and `ClippedPGConfig`."""

    needs_entropy = True

    def __init__(self, cfg: ClippedPGConfig | None = None) -> None:
        self.cfg = cfg or ClippedPGConfig()
        keys = ["token_mask", "sample_mask", "advantages", "prev_logprobs", "generation_logprobs"]
        if self.cfg.reference_policy_kl_penalty > 0:
            keys.append("reference_policy_logprobs")
        self.required_keys: tuple[str, ...] = tuple(keys)

    def prepare_batch(self, data: Any) -> Any:
        """Drop sequences whose trainer/generator logprob error is over the threshold."""
        threshold = self.cfg.seq_logprob_error_threshold
        if threshold is None:
            return data
        view = TokenView.of(data)
        err = torch.exp((data["generation_logprobs"] - data["prev_logprobs"]).abs())[:, 1:]
        seq_err = _per_sequence_mean(err, view.mask)
        out = type(data)(data)
        out["sample_mask"] = data["sample_mask"] * (seq_err <= threshold).to(
            data["sample_mask"].dtype
        )
        return out

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        *,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        view = TokenView.of(data)
        mask = view.mask
        curr = logprobs[:, 1:]
        prev = data["prev_logprobs"][:, 1:]
        gen = data["generation_logprobs"][:, 1:]
        adv = data["advantages"][:, 1:]
        if cfg.force_on_policy_ratio:
            prev = curr.detach()

        log_ratio = curr - prev
        if cfg.sequence_level_importance_ratios:
            log_ratio = _per_sequence_mean(log_ratio, mask)[:, None].expand_as(curr)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
        if cfg.disable_ppo_ratio:
            actor = -adv * curr
        elif cfg.cispo:
            actor = -adv * clipped.detach() * curr
        else:
            actor = torch.maximum(-adv * ratio, -adv * clipped)
            if cfg.ratio_clip_c is not None:
                actor = torch.where(adv < 0, torch.minimum(actor, -adv * cfg.ratio_clip_c), actor)

        if cfg.use_importance_sampling_correction:
            w = importance_weights(data["prev_logprobs"][:, 1:], gen, mask, cfg)
        else:
            w = torch.ones_like(curr)

        def reduce(per_token: torch.Tensor) -> torch.Tensor:
            if cfg.token_level_loss:
                return masked_mean(per_token, mask, global_valid_toks)
            return masked_mean(
                _per_sequence_mean(per_token, mask), view.sample_mask, global_valid_seqs
            )

        actor_loss = reduce(w * actor)
        loss = actor_loss
        metrics: dict[str, torch.Tensor] = {"actor_loss": actor_loss.detach()}
        if cfg.reference_policy_kl_penalty > 0:
            kl = kl_estimate(curr, data["reference_policy_logprobs"][:, 1:], cfg)
            kl_loss = reduce(w * kl)
            loss = loss + cfg.reference_policy_kl_penalty * kl_loss
            metrics["kl"] = kl_loss.detach()
        if cfg.positive_example_nll_coef is not None:
            positive = ((adv * mask).sum(-1) > 0).float()[:, None]
            nll = -masked_mean(curr, mask * positive, global_valid_toks)
            loss = loss + cfg.positive_example_nll_coef * nll
            metrics["positive_nll"] = nll.detach()

        def tok_mean(x: torch.Tensor) -> torch.Tensor:
            return masked_mean(x.detach().float(), mask, global_valid_toks)

        out_of_range = (ratio < 1 - cfg.ratio_clip_min) | (ratio > 1 + cfg.ratio_clip_max)
        metrics |= {
            "loss": loss.detach(),
            "probs_ratio": tok_mean(ratio),
            "probs_ratio_clamped": tok_mean(clipped),
            "clipped_fraction": tok_mean(out_of_range),
            "token_mult_prob_error": tok_mean(
                torch.exp((gen - data["prev_logprobs"][:, 1:]).abs())
            ),
            "is_weight": tok_mean(w),
        }
        if entropy is not None:
            # entropy[:, i] is of the distribution predicting token i+1: align with positions 1:.
            metrics["entropy"] = tok_mean(entropy[:, :-1])
        return loss, metrics
