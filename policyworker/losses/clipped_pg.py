"""Clipped policy-gradient loss (PPO / GRPO and relatives), with NeMo-RL's exact semantics.

Per token (positions 1:, mask = token_mask * sample_mask), with r = exp(curr - prev):

    actor = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))      (PPO surrogate)
          -> min(actor, -A * c) where A < 0                             (dual clip, c > 1)
          -> -A * curr                                                 (disable_ppo_ratio)
          -> -A * sg(clip(r)) * curr                                   (CISPO)
    r     -> exp(masked mean of log r over the sequence)               (GSPO)
    prev  -> sg(curr) everywhere                                       (force_on_policy_ratio)
    w     =  exp(prev - gen) (NaN/inf -> 0); one weight per sequence, exp(sum(prev - gen)),
             under GSPO; truncated by tis (clamp) / icepop (zero outside) / seq-mask-tis (zero
             whole sequences whose geometric-mean ratio is outside)
    kl    =  clamp(w_kl * k(clamp(ref - curr, +-in)), +-out), w_kl = exp(curr - sg(curr)), or
             exp(curr - gen) with the on-policy approximation; w_kl is detached where the input
             clamp is active, so a clamped token has no gradient
    total =  reduce(w * actor) + beta * reduce(kl) + mu * NLL(samples with reward > 0)

`reduce` is a token mean over the global batch (token_level_loss) or a mean per sequence, then
over sequences. The importance weight w multiplies the actor term only. docs/semantics.md lists
every option and metric.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from policyworker.losses.common import Loss, LossInputs, LossNeeds, TokenView, masked_mean
from policyworker.schema import build, refuse_non_finite

TruncationType = Literal["tis", "icepop", "seq-mask-tis"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ClippedPGConfig:
    """Options of `ClippedPGLoss`, named as NeMo-RL's `ClippedPGLossConfig`; defaults are GRPO's."""

    ratio_clip_min: float = 0.2
    """eps_low: the ratio is clipped below at 1 - eps_low."""
    ratio_clip_max: float = 0.2
    """eps_high: the ratio is clipped above at 1 + eps_high."""
    ratio_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None: off)."""
    disable_ppo_ratio: bool = False
    """REINFORCE on the logprob: loss -A * curr, no ratio, no clipping."""
    force_on_policy_ratio: bool = False
    """prev := sg(curr) everywhere (r == 1, the on-policy gradient); prev_logprobs is not read."""
    use_cispo: bool = False
    """CISPO: -A * sg(clip(r)) * curr."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, the exp of its masked mean log-ratio (needs
    token_level_loss=False)."""
    token_level_loss: bool = True
    """Mean over all tokens of the global batch (True) or per sequence, then over sequences."""
    use_importance_sampling_correction: bool = False
    """Weight the actor term by exp(prev - gen) for trainer/generator mismatch."""
    truncated_importance_sampling_type: TruncationType | None = None
    """tis: clamp w to [min, max]; icepop: zero w outside [min, max]; seq-mask-tis: zero whole
    sequences whose geometric-mean ratio is outside [min, max]."""
    truncated_importance_sampling_ratio: float | None = None
    """Upper bound of the truncation (required with a truncation type)."""
    truncated_importance_sampling_ratio_min: float | None = None
    """Lower bound of the truncation (tis: default 0; required for icepop and seq-mask-tis)."""
    reference_policy_kl_penalty: float = 0.01
    """beta: weight of the KL to the reference policy (0 disables it)."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3)."""
    kl_input_clamp_value: float | None = 20.0
    """Clamp of the log-ratio ref - curr before the estimator (None: off)."""
    kl_output_clamp_value: float | None = 10.0
    """Clamp of the weighted per-token KL (None: off)."""
    use_on_policy_kl_approximation: bool = False
    """Weight the KL by exp(curr - gen) (samples come from the generator), not exp(curr - sg(curr))."""
    use_kl_in_reward: bool = False
    """The KL goes into the reward (the caller's job, e.g. Reinforce++): no KL term in the loss."""
    positive_example_nll_weight: float = 0.0
    """mu: add mu * NLL of samples whose `rewards` [B] is > 0 (VAPO); 0 disables it."""
    seq_logprob_error_threshold: float | None = None
    """Drop (sample_mask = 0) sequences whose mean exp(|gen - prev|) exceeds this (None: keep)."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def kl_in_loss(self) -> bool:
        return self.reference_policy_kl_penalty != 0 and not self.use_kl_in_reward


def _validate(c: ClippedPGConfig) -> None:
    def refuse(bad: bool, message: str) -> None:
        if bad:
            raise ValueError(message)

    refuse_non_finite(c)
    for name in ("ratio_clip_min", "ratio_clip_max", "reference_policy_kl_penalty"):
        refuse(getattr(c, name) < 0, f"{name}: expected >= 0, got {getattr(c, name)}")
    refuse(
        c.ratio_clip_c is not None and c.ratio_clip_c <= 1,
        f"ratio_clip_c: expected > 1 or None, got {c.ratio_clip_c}",
    )
    refuse(
        c.reference_policy_kl_type not in ("k1", "k2", "k3"),
        f"reference_policy_kl_type: expected k1/k2/k3, got {c.reference_policy_kl_type!r}",
    )
    for name in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(c, name)
        refuse(value is not None and value <= 0, f"{name}: expected > 0 or None, got {value}")
    refuse(
        c.positive_example_nll_weight < 0,
        f"positive_example_nll_weight: expected >= 0, got {c.positive_example_nll_weight}",
    )
    refuse(
        c.seq_logprob_error_threshold is not None and c.seq_logprob_error_threshold <= 0,
        f"seq_logprob_error_threshold: expected > 0 or None, got {c.seq_logprob_error_threshold}",
    )
    refuse(
        c.sequence_level_importance_ratios and c.token_level_loss,
        "sequence_level_importance_ratios: GSPO needs token_level_loss=False",
    )
    if c.use_cispo:
        for name in (
            "disable_ppo_ratio",
            "force_on_policy_ratio",
            "sequence_level_importance_ratios",
        ):
            refuse(getattr(c, name), f"use_cispo: cannot be combined with {name}")
        refuse(c.ratio_clip_c is not None, "use_cispo: cannot be combined with ratio_clip_c")
        refuse(not c.token_level_loss, "use_cispo: needs token_level_loss=True")
    _validate_truncation(c, refuse)


def _validate_truncation(c: ClippedPGConfig, refuse: Callable[[bool, str], None]) -> None:
    kind, hi, lo = (
        c.truncated_importance_sampling_type,
        c.truncated_importance_sampling_ratio,
        c.truncated_importance_sampling_ratio_min,
    )
    if kind is None:
        refuse(
            hi is not None or lo is not None,
            "truncated_importance_sampling_ratio(_min): set truncated_importance_sampling_type too",
        )
        return
    kinds = ("tis", "icepop", "seq-mask-tis")
    refuse(kind not in kinds, f"truncated_importance_sampling_type: expected one of {kinds}")
    refuse(
        not c.use_importance_sampling_correction,
        f"truncated_importance_sampling_type={kind!r}: needs use_importance_sampling_correction",
    )
    refuse(
        hi is None or hi <= 0,
        f"truncated_importance_sampling_ratio: expected > 0 with a truncation type, got {hi}",
    )
    refuse(
        lo is not None and hi is not None and lo > hi,
        "truncated_importance_sampling_ratio_min: expected <= truncated_importance_sampling_ratio",
    )
    refuse(
        kind in ("icepop", "seq-mask-tis") and lo is None,
        f"truncated_importance_sampling_ratio_min: required with {kind!r}",
    )
    refuse(
        kind == "seq-mask-tis" and c.sequence_level_importance_ratios,
        "truncated_importance_sampling_type='seq-mask-tis': cannot be combined with "
        "sequence_level_importance_ratios",
    )


def kl_estimate(
    logprobs: torch.Tensor,
    reference: torch.Tensor,
    kl_type: str,
    *,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(p || ref) from logprobs (Schulman's k1/k2/k3).

    With `weights`, the estimate is multiplied by them before the output clamp; where the input
    clamp is active the weights are detached, so a clamped token contributes no gradient.
    """
    logr = reference - logprobs
    if input_clamp is not None:
        clamped = logr.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(logr == clamped, weights, weights.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    else:
        kl = torch.exp(logr) - 1 - logr
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def mismatch_metrics(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, toks: torch.Tensor, kl_type: str
) -> dict[str, torch.Tensor]:
    """Trainer/generator disagreement: `token_mult_prob_error` (mean exp|gen - prev|, ~1 when they
    agree), KL(gen || train), KL(train || gen) and their Jensen-Shannon divergence."""
    with torch.no_grad():
        log_mix = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
        kl_prev_mix = torch.exp(prev - log_mix) - (prev - log_mix) - 1
        kl_gen_mix = torch.exp(gen - log_mix) - (gen - log_mix) - 1
        return {
            "token_mult_prob_error": masked_mean(torch.exp((gen - prev).abs() * mask), mask, toks),
            "gen_kl_error": masked_mean(kl_estimate(gen, prev, kl_type), mask, toks),
            "policy_kl_error": masked_mean(kl_estimate(prev, gen, kl_type), mask, toks),
            "js_divergence_error": masked_mean(0.5 * kl_prev_mix + 0.5 * kl_gen_mix, mask, toks),
        }


def _ratio_metrics(
    ratios: torch.Tensor, clamped: torch.Tensor, mask: torch.Tensor, toks: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Mean, min and max of the ratio and the clamped ratio over the masked tokens (min/max of an
    empty mask: +inf / -inf, which the min/max reduction over micro-batches ignores)."""
    with torch.no_grad():
        valid = mask.bool()
        out = {}
        for name, r in (("probs_ratio", ratios), ("probs_ratio_clamped", clamped)):
            r = r.detach().expand_as(mask)
            inf = torch.full((1,), float("inf"), dtype=r.dtype, device=r.device)
            out[name] = masked_mean(r, mask, toks)
            out[f"{name}_min"] = torch.cat([r[valid], inf]).amin()
            out[f"{name}_max"] = torch.cat([r[valid], -inf]).amax()
        return out


class ClippedPGLoss(Loss):
    """PPO/GRPO-family loss; see the module docstring and `ClippedPGConfig`."""

    def __init__(self, cfg: ClippedPGConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg = build(ClippedPGConfig, cfg)
        self.needs = LossNeeds(logprobs=True, entropy=True)
        keys = ["token_mask", "sample_mask", "advantages", "generation_logprobs"]
        if not cfg.force_on_policy_ratio or cfg.seq_logprob_error_threshold is not None:
            keys.append("prev_logprobs")
        if cfg.kl_in_loss:
            keys.append("reference_policy_logprobs")
        if cfg.positive_example_nll_weight > 0:
            keys.append("rewards")
        self.required_keys = tuple(keys)

    def prepare_batch(self, data: Any) -> Any:
        """Drop sequences whose trainer/generator logprob error is over the threshold."""
        threshold = self.cfg.seq_logprob_error_threshold
        if threshold is None:
            return data
        view = TokenView.of(data)
        err = torch.exp((data["generation_logprobs"] - data["prev_logprobs"]).abs())[:, 1:]
        seq_err = masked_mean(err, view.token_mask, dim=-1)
        out = type(data)(data)
        out["sample_mask"] = data["sample_mask"] * (seq_err <= threshold).to(
            data["sample_mask"].dtype
        )
        return out

    @property
    def normalizer(self) -> str | None:
        if self.cfg.positive_example_nll_weight > 0:
            return None  # the NLL term divides by global_positive_toks
        return "global_valid_toks" if self.cfg.token_level_loss else "global_valid_seqs"

    def counts(self, data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().counts(data)
        if self.cfg.positive_example_nll_weight > 0:
            view = TokenView.of(data)
            positive = (data["rewards"] > 0).float()
            out["global_positive_toks"] = (view.mask * positive[:, None]).sum()
        return out

    def _reduce(
        self, per_token: torch.Tensor, view: TokenView, counts: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        if self.cfg.token_level_loss:
            return masked_mean(per_token, view.mask, counts["global_valid_toks"])
        per_seq = masked_mean(per_token, view.token_mask, dim=-1)
        return masked_mean(per_seq, view.sample_mask, counts["global_valid_seqs"])

    def __call__(
        self,
        inputs: LossInputs,
        data: Mapping[str, torch.Tensor],
        counts: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        assert inputs.logprobs is not None
        view, toks = TokenView.of(data), counts["global_valid_toks"]
        curr = inputs.logprobs[:, 1:]
        adv = data["advantages"][:, 1:]
        gen = data["generation_logprobs"][:, 1:]
        prev = curr.detach() if cfg.force_on_policy_ratio else data["prev_logprobs"][:, 1:]
        metrics = mismatch_metrics(prev, gen, view.mask, toks, cfg.reference_policy_kl_type)

        kl = curr.new_zeros(())
        if cfg.kl_in_loss:
            weights = torch.exp(
                curr - (gen if cfg.use_on_policy_kl_approximation else curr.detach())
            )
            per_token_kl = cfg.reference_policy_kl_penalty * kl_estimate(
                curr,
                data["reference_policy_logprobs"][:, 1:],
                cfg.reference_policy_kl_type,
                input_clamp=cfg.kl_input_clamp_value,
                output_clamp=cfg.kl_output_clamp_value,
                weights=_finite(weights),
            )
            kl = self._reduce(per_token_kl, view, counts)
            metrics["kl_penalty"] = kl.detach() / cfg.reference_policy_kl_penalty
        else:
            metrics["kl_penalty"] = kl

        ratios, clamped, actor = self._actor(curr, prev, adv, view)
        weights, is_metrics = self._importance_weights(prev, gen, view, counts)
        if not cfg.use_importance_sampling_correction:
            weights = torch.ones_like(curr)
        actor_loss = self._reduce(weights * actor, view, counts)

        nll = curr.new_zeros(())
        if cfg.positive_example_nll_weight > 0:
            positive = (data["rewards"] > 0).float()[:, None]
            nll = masked_mean(-curr, view.mask * positive, counts["global_positive_toks"])
        loss = actor_loss + kl + cfg.positive_example_nll_weight * nll

        with torch.no_grad():
            clipped = (ratios != clamped).float()
            if cfg.disable_ppo_ratio and not cfg.force_on_policy_ratio:
                # The reference reports the mean logprob here; the ratio is the meaningful value.
                ratios = clamped = torch.exp(curr - prev)
            metrics |= _ratio_metrics(ratios, clamped, view.mask, toks)
            metrics |= is_metrics
            metrics |= {
                "loss": loss.detach(),
                "actor_loss": actor_loss.detach(),
                "positive_nll_loss": nll.detach(),
                "num_valid_samples": view.sample_mask.sum(),
                "clipped_fraction": masked_mean(clipped, view.mask, toks),
                "approx_entropy": -masked_mean(torch.exp(curr - gen) * curr, view.mask, toks),
            }
            if inputs.entropy is not None:
                # entropy[:, i] is of the distribution predicting token i+1: align with 1:.
                metrics["entropy"] = masked_mean(inputs.entropy[:, :-1].float(), view.mask, toks)
        return loss, metrics

    def _actor(
        self, curr: torch.Tensor, prev: torch.Tensor, adv: torch.Tensor, view: TokenView
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ratios, clamped ratios, per-token actor loss) under the configured variant."""
        cfg = self.cfg
        if cfg.force_on_policy_ratio:  # wins over disable_ppo_ratio, as in the reference
            ratios = clamped = torch.exp(curr - curr.detach())
        elif cfg.disable_ppo_ratio:
            ratios = clamped = curr
        else:
            log_ratios = curr - prev
            if cfg.sequence_level_importance_ratios:
                seq = masked_mean(log_ratios, view.token_mask, dim=-1)[:, None]
                log_ratios = seq.expand_as(curr)
            ratios = torch.exp(log_ratios)
            clamped = ratios.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        if cfg.use_cispo:
            actor = -adv * clamped.detach() * curr
        else:
            actor = torch.maximum(-adv * ratios, -adv * clamped)
        if cfg.ratio_clip_c is not None:
            actor = torch.where(adv < 0, torch.minimum(actor, -adv * cfg.ratio_clip_c), actor)
        return ratios, clamped, actor

    def _importance_weights(
        self,
        prev: torch.Tensor,
        gen: torch.Tensor,
        view: TokenView,
        counts: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Truncated importance weights ([B, S-1], or [B, 1] under GSPO) and their metrics."""
        cfg = self.cfg
        toks, seqs = counts["global_valid_toks"], counts["global_valid_seqs"]
        if cfg.sequence_level_importance_ratios:
            w = _finite(torch.exp(((prev - gen) * view.mask).sum(-1, keepdim=True)).detach())
        else:
            w = _finite(torch.exp(prev - gen))
        metrics: dict[str, torch.Tensor] = {}
        kind, hi = cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio
        lo = cfg.truncated_importance_sampling_ratio_min
        if kind == "tis":
            lo = 0.0 if lo is None else lo
            metrics["is_oob_ratio"] = masked_mean(((w > hi) | (w < lo)).float(), view.mask, toks)
            w = w.clamp(lo, hi)
        elif kind == "icepop":
            keep = (w >= lo) & (w <= hi)
            metrics["is_oob_ratio"] = masked_mean((~keep).float(), view.mask, toks)
            w = torch.where(keep, w, torch.zeros_like(w))
        elif kind == "seq-mask-tis":
            log_w = masked_mean(_finite(prev - gen), view.token_mask, dim=-1)
            geo = torch.exp(log_w).detach()
            keep = ((geo >= lo) & (geo <= hi)).float()
            metrics["is_oob_ratio"] = masked_mean(1.0 - keep, view.sample_mask, seqs)
            w = w * keep[:, None]
        if cfg.sequence_level_importance_ratios:
            metrics["sampling_importance_ratio"] = masked_mean(
                w.squeeze(-1), view.sample_mask, seqs
            )
        else:
            metrics["sampling_importance_ratio"] = masked_mean(w, view.mask, toks)
        return w, metrics
