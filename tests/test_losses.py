"""The losses against NeMo-RL's own golden cases and against values computed by hand.

ClippedPG: every golden case of the reference (loss, gradient and metrics, float64, 1e-12), then
each place where we used to depart from it, as its own hand-computed test. NLL, DPO and
distillation: the reference's unit-test cases and a brute-force full-vocabulary computation.
"""

import math

import pytest
import torch
from logit_ops import index_logprobs, token_logprobs, vocab_parallel_entropy
from reference_pg_cases import BASE, CASES

from policyworker.losses import (
    ClippedPGConfig,
    ClippedPGLoss,
    DistillationConfig,
    DistillationLoss,
    DPOConfig,
    DPOLoss,
    FullDistillationConfig,
    FullDistillationLoss,
    LossInputs,
    NLLLoss,
    masked_mean,
)
from policyworker.train.step import reduce_metrics

F64 = torch.float64


def _data(**overrides):
    values = {**BASE, **overrides}
    data = {k: torch.tensor(v, dtype=F64) for k, v in values.items() if k != "next_token_logprobs"}
    data["input_ids"] = torch.zeros(2, 5, dtype=torch.long)
    return data


def _run(loss_fn, data, next_lp):
    """(loss, d loss / d next_token_logprobs, metrics) with counts in float64 as the reference."""
    next_lp = torch.tensor(next_lp, dtype=F64, requires_grad=True)
    logprobs = torch.cat([next_lp.new_zeros(next_lp.shape[0], 1), next_lp], dim=1)
    counts = {k: v.to(F64) for k, v in loss_fn.counts(data).items()}
    loss, metrics = loss_fn(LossInputs(logprobs=logprobs), data, counts)
    (grad,) = torch.autograd.grad(loss, next_lp)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("name", CASES)
def test_clipped_pg_equals_reference_goldens(name):
    case = CASES[name]
    loss_fn = ClippedPGLoss(ClippedPGConfig(**case["config"]))
    data = _data(**case.get("inputs", {}))
    loss, grad, metrics = _run(loss_fn, data, BASE["next_token_logprobs"])
    torch.testing.assert_close(loss, torch.tensor(case["loss"], dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.tensor(case["grad"], dtype=F64), rtol=1e-12, atol=1e-12)
    for key, want in case["metrics"].items():
        assert float(metrics[key]) == pytest.approx(want, rel=1e-12, abs=1e-12), key


def test_disable_ppo_ratio_reports_the_probability_ratio():
    loss_fn = ClippedPGLoss(ClippedPGConfig(reference_policy_kl_penalty=0, disable_ppo_ratio=True))
    _, _, m = _run(loss_fn, _data(), BASE["next_token_logprobs"])
    # The reference reports the mean logprob (-1.12); the ratio exp(curr - prev) is the PPO one.
    assert float(m["probs_ratio"]) == pytest.approx(CASES["ppo_token"]["metrics"]["probs_ratio"])
    assert float(m["clipped_fraction"]) == 0.0


# --- the departures of the old ClippedPGLoss, each by hand ---------------------------------------


def _tokens(data):
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


def _k3(logr):
    return math.exp(logr) - 1 - logr


def test_importance_weights_multiply_the_actor_term_only():
    beta = 0.1
    cfg = dict(use_importance_sampling_correction=True, reference_policy_kl_penalty=beta)
    data = _data()
    loss, _, m = _run(ClippedPGLoss(ClippedPGConfig(**cfg)), data, BASE["next_token_logprobs"])
    curr, toks = BASE["next_token_logprobs"], _tokens(data)
    actor = kl = 0.0
    for b, t in toks:
        c, a = curr[b][t], BASE["advantages"][b][t + 1]
        p, g = BASE["prev_logprobs"][b][t + 1], BASE["generation_logprobs"][b][t + 1]
        r = math.exp(c - p)
        w = math.exp(p - g)
        actor += w * max(-a * r, -a * min(max(r, 0.8), 1.2))
        kl += _k3(BASE["reference_policy_logprobs"][b][t + 1] - c)  # no w here
    n = len(toks)
    assert float(loss) == pytest.approx(actor / n + beta * kl / n, rel=1e-7)
    assert float(m["kl_penalty"]) == pytest.approx(kl / n, rel=1e-7)


def test_icepop_keeps_the_kl_on_filtered_tokens():
    base = dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.25,
        truncated_importance_sampling_ratio_min=0.75,
    )
    with_kl = _run(
        ClippedPGLoss(ClippedPGConfig(**base, reference_policy_kl_penalty=0.1)),
        _data(),
        BASE["next_token_logprobs"],
    )
    no_kl = _run(
        ClippedPGLoss(ClippedPGConfig(**base, reference_policy_kl_penalty=0.0)),
        _data(),
        BASE["next_token_logprobs"],
    )
    # icepop zeroes the actor gradient of 3 of 5 tokens; the KL still reaches all 5.
    kl_grad = with_kl[1] - no_kl[1]
    assert (kl_grad[_data()["token_mask"][:, 1:] > 0] != 0).all()


def test_clamped_kl_tokens_have_no_gradient():
    beta, clamp_in, clamp_out = 0.5, 2.0, 1.0
    data = _data(
        reference_policy_logprobs=[[0.0, -4.0, -0.7, -1.4, 0.0], [0.0, -1.3, -3.5, 0.0, 0.0]]
    )
    cfg = ClippedPGConfig(
        reference_policy_kl_penalty=beta,
        kl_input_clamp_value=clamp_in,
        kl_output_clamp_value=clamp_out,
        ratio_clip_min=10.0,
        ratio_clip_max=10.0,
    )
    adv0 = _data(
        advantages=[[0.0] * 5] * 2,
        reference_policy_logprobs=data["reference_policy_logprobs"].tolist(),
    )
    _, grad, _ = _run(ClippedPGLoss(cfg), adv0, BASE["next_token_logprobs"])
    curr = BASE["next_token_logprobs"]
    n = len(_tokens(adv0))
    for b, t in _tokens(adv0):
        logr = float(adv0["reference_policy_logprobs"][b, t + 1]) - curr[b][t]
        if abs(logr) > clamp_in or _k3(max(-clamp_in, min(clamp_in, logr))) > clamp_out:
            assert float(grad[b, t]) == 0.0, (b, t)  # a clamp is active: no gradient at all
        else:  # d/dc [exp(c - sg(c)) * k3(ref - c)] = k3 + 1 - exp(ref - c)
            want = beta / n * (_k3(logr) + 1 - math.exp(logr))
            assert float(grad[b, t]) == pytest.approx(want, rel=1e-7), (b, t)
    off = ClippedPGConfig(
        reference_policy_kl_penalty=beta, kl_input_clamp_value=None, kl_output_clamp_value=None
    )
    _, grad_off, _ = _run(ClippedPGLoss(off), adv0, BASE["next_token_logprobs"])
    assert (grad_off[_data()["token_mask"][:, 1:] > 0] != 0).all()  # clamps off: every token


def test_gspo_uses_one_truncated_weight_per_sequence():
    cfg = ClippedPGConfig(
        reference_policy_kl_penalty=0.0,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.3,
    )
    data = _data()
    loss, _, _ = _run(ClippedPGLoss(cfg), data, BASE["next_token_logprobs"])
    curr, toks = BASE["next_token_logprobs"], _tokens(data)
    total = 0.0
    for b in range(2):
        ts = [t for bb, t in toks if bb == b]
        p = [BASE["prev_logprobs"][b][t + 1] for t in ts]
        g = [BASE["generation_logprobs"][b][t + 1] for t in ts]
        w = min(math.exp(sum(p) - sum(g)), 1.3)  # sum, not mean, of the log-ratio; then truncated
        r = math.exp(sum(curr[b][t] - pp for t, pp in zip(ts, p, strict=True)) / len(ts))
        per_tok = [
            w * max(-a * r, -a * min(max(r, 0.8), 1.2))
            for a in (BASE["advantages"][b][t + 1] for t in ts)
        ]
        total += sum(per_tok) / len(ts)
    assert float(loss) == pytest.approx(total / 2, rel=1e-7)


def test_force_on_policy_ignores_prev_and_wins_over_disable_ppo_ratio():
    cfg = ClippedPGConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True)
    loss_fn = ClippedPGLoss(cfg)
    assert "prev_logprobs" not in loss_fn.required_keys
    a = _run(loss_fn, _data(prev_logprobs=[[0.0] * 5] * 2), BASE["next_token_logprobs"])
    b = _run(loss_fn, _data(), BASE["next_token_logprobs"])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert float(a[2]["token_mult_prob_error"]) == float(b[2]["token_mult_prob_error"])
    both = ClippedPGConfig(
        reference_policy_kl_penalty=0.0, force_on_policy_ratio=True, disable_ppo_ratio=True
    )
    loss, grad, _ = _run(ClippedPGLoss(both), _data(), BASE["next_token_logprobs"])
    toks = _tokens(_data())
    adv = [BASE["advantages"][b][t + 1] for b, t in toks]
    assert float(loss) == pytest.approx(-sum(adv) / len(adv), rel=1e-8)  # -A, not -A * curr
    for (b, t), a_ in zip(toks, adv, strict=True):
        assert float(grad[b, t]) == pytest.approx(-a_ / len(adv), rel=1e-8)


def test_seq_mask_tis_keeps_a_sequence_with_a_minus_inf_generation_logprob():
    gen = [row[:] for row in BASE["generation_logprobs"]]
    gen[1][1] = -math.inf  # a token the generator filtered out
    cfg = ClippedPGConfig(
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.5,
    )
    loss, grad, m = _run(
        ClippedPGLoss(cfg), _data(generation_logprobs=gen), BASE["next_token_logprobs"]
    )
    assert math.isfinite(float(loss))
    # log-ratio sanitized to 0 at the -inf token: sequence 1's mean is (0 + (-1.0 + 0.7)) / 2
    assert math.exp((0 - 0.3) / 2) > 0.5 and float(m["is_oob_ratio"]) == 0.0
    assert float(grad[1, 1]) != 0.0  # its other token still trains


def test_positive_nll_selects_by_reward_not_advantage():
    # An all-correct group has advantage 0 everywhere, but its samples have reward 1.
    data = _data(advantages=[[0.0] * 5] * 2, rewards=[1.0, 1.0])
    cfg = ClippedPGConfig(reference_policy_kl_penalty=0.0, positive_example_nll_weight=0.5)
    loss_fn = ClippedPGLoss(cfg)
    assert "rewards" in loss_fn.required_keys
    loss, _, m = _run(loss_fn, data, BASE["next_token_logprobs"])
    curr = BASE["next_token_logprobs"]
    nll = -sum(curr[b][t] for b, t in _tokens(data)) / len(_tokens(data))
    assert float(m["positive_nll_loss"]) == pytest.approx(nll, rel=1e-7)
    assert float(loss) == pytest.approx(0.5 * nll, rel=1e-7)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"use_cispo": True, "ratio_clip_c": 3.0}, "use_cispo"),
        ({"use_cispo": True, "force_on_policy_ratio": True}, "use_cispo"),
        ({"use_cispo": True, "disable_ppo_ratio": True}, "use_cispo"),
        (
            {
                "use_cispo": True,
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
            },
            "use_cispo",
        ),
        ({"use_cispo": True, "token_level_loss": False}, "use_cispo"),
        ({"sequence_level_importance_ratios": True}, "sequence_level_importance_ratios"),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 0.5,
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
            },
            "seq-mask-tis",
        ),
        (
            {
                "truncated_importance_sampling_type": "tis",
                "truncated_importance_sampling_ratio": 2.0,
            },
            "use_importance_sampling_correction",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 2.0,
            },
            "truncated_importance_sampling_ratio_min",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "tis",
            },
            "truncated_importance_sampling_ratio",
        ),
        ({"truncated_importance_sampling_ratio": 2.0}, "truncated_importance_sampling_type"),
        ({"ratio_clip_c": 1.0}, "ratio_clip_c"),
        ({"ratio_clip_min": -0.1}, "ratio_clip_min"),
        ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
        ({"kl_input_clamp_value": 0.0}, "kl_input_clamp_value"),
        ({"positive_example_nll_weight": -1.0}, "positive_example_nll_weight"),
    ],
)
def test_bad_loss_options_raise(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        ClippedPGConfig(**kwargs)


def test_seq_logprob_error_threshold_drops_sequences():
    data = _data()
    data["generation_logprobs"][1, 2] -= 5.0  # sequence 1 now disagrees badly
    out = ClippedPGLoss(ClippedPGConfig(seq_logprob_error_threshold=2.0)).prepare_batch(data)
    assert out["sample_mask"].tolist() == [1.0, 0.0]
    assert data["sample_mask"].tolist() == [1.0, 1.0]  # the caller's batch is untouched


# --- NLL and DPO: the reference's unit-test cases -----------------------------------------------


def _logprobs_from_logits(logits, ids):
    return token_logprobs(logits, ids, temperature=1.0, tp_group=None, tp_rank=0)


def test_nll_reference_cases():
    ids = torch.arange(4)[None, :]
    data = {
        "input_ids": ids,
        "token_mask": torch.tensor([[0, 0, 1, 1.0]]),
        "sample_mask": torch.ones(1),
    }
    for target_offset, want in ((0, 0.0), (-1, 999.0)):  # confident and right / confident and wrong
        logits = torch.zeros(1, 4, 8)
        for i in range(3):
            logits[0, i, i + 1 + target_offset] = 999.0
        lp = _logprobs_from_logits(logits, ids)
        loss_fn = NLLLoss()
        loss, m = loss_fn(LossInputs(logprobs=lp), data, loss_fn.counts(data))
        assert float(loss) == pytest.approx(want, abs=1e-4)
        assert float(m["num_unmasked_tokens"]) == 2


def _dpo_data(batch_pairs=1, seq=4, vocab=16):
    return {
        "input_ids": torch.arange(vocab // 2).reshape(2 * batch_pairs, seq),
        "token_mask": torch.tensor([[0, 0, 1, 1.0], [0, 0, 1, 1.0]]),
        "sample_mask": torch.ones(2),
        "reference_policy_logprobs": torch.zeros(2 * batch_pairs, seq),
    }


def _dpo(cfg, data, logits):
    loss_fn = DPOLoss(cfg)
    lp = _logprobs_from_logits(logits, data["input_ids"])
    return loss_fn(LossInputs(logprobs=lp), data, loss_fn.counts(data))


def test_dpo_reference_cases():
    data, logits = _dpo_data(), torch.zeros(2, 4, 16)
    loss, _ = _dpo(DPOConfig(reference_policy_kl_penalty=0.0), data, logits)
    assert float(loss) == pytest.approx(math.log(2))  # -logsigmoid(0): equal rewards
    loss, m = _dpo(DPOConfig(reference_policy_kl_penalty=0.0, sft_loss_weight=0.5), data, logits)
    expected_sft = math.log(16) * 2  # two chosen tokens, each -log(1/16)
    assert float(loss) == pytest.approx(0.5 * expected_sft + math.log(2))
    assert float(m["sft_loss"]) == pytest.approx(expected_sft)


def test_dpo_averaging_over_varying_lengths():
    lengths = [3, 5, 4, 6]
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 6)
    for i, n in enumerate(lengths):
        ids[i, :n], mask[i, :n] = torch.arange(n), 1.0
    data = {
        "input_ids": ids,
        "token_mask": mask,
        "sample_mask": torch.ones(4),
        "reference_policy_logprobs": torch.zeros(4, 6),
    }
    logits = torch.zeros(4, 6, 10)
    base = dict(reference_policy_kl_penalty=0.1, sft_loss_weight=0.5)
    _, m = _dpo(DPOConfig(**base), data, logits)
    _, m_avg = _dpo(
        DPOConfig(**base, preference_average_log_probs=True, sft_average_log_probs=True),
        data,
        logits,
    )
    per_token = math.log(10)  # uniform logits
    chosen_tokens = [n - 1 for n in lengths[::2]]  # positions 1: of the chosen rows
    assert float(m["sft_loss"]) == pytest.approx(per_token * sum(chosen_tokens) / 2)
    assert float(m_avg["sft_loss"]) == pytest.approx(per_token)


def test_dpo_by_hand():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(4, 5, generator=g, dtype=F64)
    lp[:, 0] = 0
    ref = -torch.rand(4, 5, generator=g, dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1.0]])
    data = {
        "token_mask": mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 0.0]),
        "reference_policy_logprobs": ref,
    }
    beta = 0.3
    loss_fn = DPOLoss(DPOConfig(reference_policy_kl_penalty=beta, sft_loss_weight=0.2))
    counts = {k: v.to(F64) for k, v in loss_fn.counts(data).items()}
    loss, m = loss_fn(LossInputs(logprobs=lp), data, counts)
    r = [float(((lp[i, 1:] - ref[i, 1:]) * mask[i, 1:]).sum()) for i in range(4)]
    pref = -math.log(1 / (1 + math.exp(-beta * (r[0] - r[1]))))  # only pair 0 is valid
    sft = -float((lp[0, 1:] * mask[0, 1:]).sum())
    assert float(loss) == pytest.approx(pref + 0.2 * sft, rel=1e-7)
    assert float(m["rewards_margin_mean"]) == pytest.approx(r[0] - r[1], rel=1e-7)
    assert float(m["accuracy"]) == pytest.approx(float(r[0] > r[1]))
    assert float(m["num_valid_samples"]) == 1.0
    assert DPOLoss().rows_per_example == 2


# --- distillation against a brute-force full-vocabulary computation -----------------------------


def _brute_force_distillation(logits, t_logits, t_idx, mask, cfg):
    """The reference's formulas on plain full-vocabulary tensors (fp64)."""
    full = torch.log_softmax(logits, -1)
    s = full.gather(-1, t_idx)[:, :-1]
    if not cfg.zero_outside_topk:
        s = torch.log_softmax(logits.gather(-1, t_idx), -1)[:, :-1]
    t = torch.log_softmax(t_logits, -1)[:, :-1]
    fwd = (t.exp() * (t - s)).sum(-1)
    rev = (s.exp() * (s - t)).sum(-1)
    w = {"forward": 1.0, "reverse": 0.0, "mixed": cfg.mixed_kl_weight}[cfg.kl_type]
    kl = w * fwd + (1 - w) * rev
    if cfg.zero_outside_topk and cfg.kl_type != "forward":
        h_all = (full.exp() * full).sum(-1)[:, :-1]
        h_rest = h_all - (s.exp() * s).sum(-1)
        kl = kl + (1 - w) * (h_rest + 100.0 * (1 - s.exp().sum(-1)))
    m = mask[:, 1:]
    return (kl * m).sum() / (m.sum() + 1e-8)


@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_distillation_equals_brute_force(kl_type, zero_outside_topk):
    g = torch.Generator().manual_seed(2)
    b, s, v, k = 2, 6, 11, 3
    logits = torch.randn(b, s, v, generator=g, dtype=F64, requires_grad=True)
    t_logits = torch.randn(b, s, k, generator=g, dtype=F64)
    t_idx = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(b * s)]).reshape(b, s, k)
    mask = (torch.rand(b, s, generator=g) > 0.3).to(F64)
    data = {
        "token_mask": mask,
        "sample_mask": torch.ones(b, dtype=F64),
        "teacher_topk_logits": t_logits,
        "teacher_topk_indices": t_idx,
    }
    cfg = DistillationConfig(
        kl_type=kl_type, mixed_kl_weight=0.3, zero_outside_topk=zero_outside_topk
    )
    loss_fn = DistillationLoss(cfg)
    tp = dict(temperature=1.0, tp_group=None)
    inputs = LossInputs(
        index_logprobs=index_logprobs(logits, t_idx, **tp, tp_rank=0),
        entropy=vocab_parallel_entropy(logits, **tp) if loss_fn.needs.entropy else None,
    )
    counts = {k_: v_.to(F64) for k_, v_ in loss_fn.counts(data).items()}
    loss, _ = loss_fn(inputs, data, counts)
    (grad,) = torch.autograd.grad(loss, logits)
    want = _brute_force_distillation(logits, t_logits, t_idx, mask, cfg)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-8, atol=1e-12)


def test_distillation_of_the_teacher_itself_is_zero():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 5, 9, generator=g)
    vals, idx = logits.topk(4, dim=-1)
    data = {
        "token_mask": torch.ones(1, 5),
        "sample_mask": torch.ones(1),
        "teacher_topk_logits": vals,
        "teacher_topk_indices": idx,
    }
    loss_fn = DistillationLoss(DistillationConfig(kl_type="mixed"))
    lp = index_logprobs(logits, idx, temperature=1.0, tp_group=None, tp_rank=0)
    loss, _ = loss_fn(LossInputs(index_logprobs=lp), data, loss_fn.counts(data))
    assert abs(float(loss)) < 1e-6


# --- ops and the metric reduction ----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_index_logprobs_and_entropy_ops_equal_autograd(temperature):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 13, generator=g, dtype=F64, requires_grad=True)
    idx = torch.randint(0, 13, (2, 5, 4), generator=g)
    lp = index_logprobs(logits, idx, temperature=temperature, tp_group=None, tp_rank=0)
    ent = vocab_parallel_entropy(logits, temperature=temperature, tp_group=None)
    ref_lp = torch.log_softmax(logits / temperature, -1)
    torch.testing.assert_close(lp, ref_lp.gather(-1, idx))
    torch.testing.assert_close(ent, -(ref_lp.exp() * ref_lp).sum(-1))
    w1, w2 = torch.randn(2, 5, 4, dtype=F64), torch.randn(2, 5, dtype=F64)
    got = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), logits)[0]
    want = torch.autograd.grad(
        (ref_lp.gather(-1, idx) * w1).sum() - ((ref_lp.exp() * ref_lp).sum(-1) * w2).sum(), logits
    )[0]
    torch.testing.assert_close(got, want)


def test_reduce_metrics_sums_and_takes_extremes():
    stores = [
        {
            "loss": torch.tensor(0.25),
            "probs_ratio_min": torch.tensor(0.5),
            "probs_ratio_max": torch.tensor(1.5),
        },
        {
            "loss": torch.tensor(0.5),
            "probs_ratio_min": torch.tensor(float("inf")),
            "probs_ratio_max": torch.tensor(2.0),
        },
    ]
    assert reduce_metrics(stores, None) == {
        "loss": 0.75,
        "probs_ratio_min": 0.5,
        "probs_ratio_max": 2.0,
    }


def test_masked_mean_uses_the_given_denominator():
    v, m = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 1.0])
    assert float(masked_mean(v, m, 8.0)) == pytest.approx(0.5)
    assert float(masked_mean(v, m)) == pytest.approx(2.0)


# --- the reference's classic hand cases (ratios 0.5 / 1.0 / 1.5 around prev = -1) ---------------


def _classic(cfg, curr, prev=(-1.0, -1.0, -1.0)):
    data = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]]),
        "sample_mask": torch.ones(1),
        "advantages": torch.tensor([[0.0, 1.0, -1.0, 2.0]]),
        "prev_logprobs": torch.tensor([[0.0, *prev]]),
        "generation_logprobs": torch.tensor([[0.0, *prev]]),
        "reference_policy_logprobs": torch.zeros(1, 4),
    }
    loss_fn = ClippedPGLoss(cfg)
    lp = torch.tensor([[0.0, *curr]])
    return loss_fn(LossInputs(logprobs=lp), data, loss_fn.counts(data))


def test_reference_ppo_reinforce_and_on_policy_cases():
    ratios_curr = (math.log(0.5) - 1, -1.0, math.log(1.5) - 1)
    loss, _ = _classic(ClippedPGConfig(reference_policy_kl_penalty=0.0), ratios_curr)
    assert float(loss) == pytest.approx((-0.5 + 1.0 - 2.4) / 3, rel=1e-5)  # -0.6333
    reinforce = ClippedPGConfig(
        reference_policy_kl_penalty=0.0, disable_ppo_ratio=True, ratio_clip_min=0, ratio_clip_max=0
    )
    loss, _ = _classic(reinforce, (-0.5, -1.0, -1.5), prev=(0.0, 0.0, 0.0))
    assert float(loss) == pytest.approx((0.5 - 1.0 + 3.0) / 3, rel=1e-5)  # 0.8333
    loss, m = _classic(
        ClippedPGConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True), ratios_curr
    )
    assert float(loss) == pytest.approx((-1.0 + 1.0 - 2.0) / 3, rel=1e-5)  # -0.6667
    assert float(m["probs_ratio_min"]) == float(m["probs_ratio_max"]) == 1.0


def test_on_policy_kl_approximation_weights_the_kl_by_curr_over_gen():
    beta = 0.2
    data = _data()
    cfg = ClippedPGConfig(reference_policy_kl_penalty=beta, use_on_policy_kl_approximation=True)
    with_kl, _, m = _run(ClippedPGLoss(cfg), data, BASE["next_token_logprobs"])
    no_kl, _, _ = _run(
        ClippedPGLoss(ClippedPGConfig(reference_policy_kl_penalty=0.0)),
        data,
        BASE["next_token_logprobs"],
    )
    curr, toks = BASE["next_token_logprobs"], _tokens(data)
    kl = 0.0
    for b, t in toks:
        c, g = curr[b][t], BASE["generation_logprobs"][b][t + 1]
        kl += math.exp(c - g) * _k3(BASE["reference_policy_logprobs"][b][t + 1] - c)
    assert float(with_kl - no_kl) == pytest.approx(beta * kl / len(toks), rel=1e-7)
    assert float(m["kl_penalty"]) == pytest.approx(kl / len(toks), rel=1e-7)


def test_kl_in_reward_leaves_the_kl_out_of_the_loss():
    cfg = ClippedPGConfig(reference_policy_kl_penalty=0.5, use_kl_in_reward=True)
    loss_fn = ClippedPGLoss(cfg)
    assert "reference_policy_logprobs" not in loss_fn.required_keys
    loss, _, m = _run(loss_fn, _data(), BASE["next_token_logprobs"])
    assert float(loss) == pytest.approx(CASES["ppo_token"]["loss"], rel=1e-12)
    assert float(m["kl_penalty"]) == 0.0


_NUMBER_SETTINGS = [
    (ClippedPGConfig, "ratio_clip_min"),
    (ClippedPGConfig, "ratio_clip_max"),
    (ClippedPGConfig, "ratio_clip_c"),
    (ClippedPGConfig, "reference_policy_kl_penalty"),
    (ClippedPGConfig, "kl_input_clamp_value"),
    (ClippedPGConfig, "kl_output_clamp_value"),
    (ClippedPGConfig, "positive_example_nll_weight"),
    (ClippedPGConfig, "seq_logprob_error_threshold"),
    (DPOConfig, "reference_policy_kl_penalty"),
    (DPOConfig, "preference_loss_weight"),
    (DPOConfig, "sft_loss_weight"),
    (DistillationConfig, "mixed_kl_weight"),
    (FullDistillationConfig, "kl_coef"),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("cls,name", _NUMBER_SETTINGS)
def test_non_finite_loss_settings_are_refused_at_construction(cls, name, value):
    """A NaN compares false with every bound, so it passed the range checks and trained on
    another objective (loss NaN, a finite grad norm, every tensor changed)."""
    with pytest.raises(ValueError, match=f"{name}: expected a finite number"):
        cls(**{name: value})


def test_losses_take_the_references_dict_configs():
    """NeMo-RL's loss configs are dicts (TypedDicts) of the same keys: taken with the checks and
    messages of the dataclass path."""
    reference = {
        "reference_policy_kl_penalty": 0.1,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.28,
        "ratio_clip_c": None,
        "use_on_policy_kl_approximation": False,
        "use_importance_sampling_correction": False,
        "token_level_loss": True,
    }
    assert ClippedPGLoss(reference).cfg == ClippedPGConfig(**reference)
    assert DPOLoss({"sft_loss_weight": 1}).cfg == DPOConfig(sft_loss_weight=1.0)
    assert DistillationLoss({"kl_type": "forward"}).cfg.kl_type == "forward"
    assert FullDistillationLoss({"kl_coef": 2}).cfg.kl_coef == 2.0
    with pytest.raises(ValueError, match="ratio_clip_min: expected a finite number"):
        ClippedPGLoss({"ratio_clip_min": float("nan")})
    with pytest.raises(ValueError, match="ratio_clip: unknown field"):
        ClippedPGLoss({"ratio_clip": 0.2})
    with pytest.raises(ValueError, match="ratio_clip_max: expected a number"):
        ClippedPGLoss({"ratio_clip_max": "wide"})
    with pytest.raises(ValueError, match="cfg: expected a ClippedPGConfig or a mapping"):
        ClippedPGLoss(3)  # type: ignore[arg-type]
