"""Each loss option against values computed by hand (scalar Python, token by token)."""

import math

import pytest
import torch

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.losses import ClippedPGConfig, ClippedPGLoss, NLLLoss, masked_mean


def _batch():
    # 2 sequences x 5 positions; position 0 never counts. Sequence 1 has a masked token.
    g = torch.Generator().manual_seed(0)
    curr = -torch.rand(2, 5, generator=g) * 2
    data = BatchedDataDict(
        input_ids=torch.zeros(2, 5, dtype=torch.long),
        input_lengths=torch.tensor([5, 5]),
        token_mask=torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]], dtype=torch.float),
        sample_mask=torch.tensor([1.0, 1.0]),
        advantages=torch.tensor([[0.0, 1.5, 1.5, 1.5, 1.5], [0.0, -0.8, -0.8, -0.8, -0.8]]),
        prev_logprobs=curr + torch.tensor([[0, 0.5, -0.6, 0.1, 0.0], [0, 0.3, -0.4, 0.9, 0.2]]),
        generation_logprobs=curr
        + torch.tensor([[0, 0.4, -0.2, 3.0, 0.1], [0, 0.0, -1.2, 0.7, 0.0]]),
        reference_policy_logprobs=curr
        + torch.tensor([[0, 25.0, -0.3, 0.2, -30.0], [0, 0.1, 0.5, -0.4, 0.0]]),
    )
    return curr, data


def _tokens(data):
    """(seq, pos) pairs that the loss covers."""
    return [
        (b, t)
        for b in range(2)
        for t in range(1, 5)
        if data["token_mask"][b, t] and data["sample_mask"][b]
    ]


def _hand(cfg: ClippedPGConfig, curr: torch.Tensor, data) -> float:
    toks = _tokens(data)
    n_tok = len(toks)
    lo, hi = (
        cfg.truncated_importance_sampling_ratio_min,
        cfg.truncated_importance_sampling_ratio_max,
    )

    def f(name, b, t):
        return float(data[name][b, t])

    def seq_tokens(b):
        return [t for (bb, t) in toks if bb == b]

    per_tok = {}
    for b, t in toks:
        c, a = float(curr[b, t]), f("advantages", b, t)
        p = c if cfg.force_on_policy_ratio else f("prev_logprobs", b, t)
        if cfg.sequence_level_importance_ratios:
            lr_ = sum(float(curr[b, u]) - f("prev_logprobs", b, u) for u in seq_tokens(b)) / len(
                seq_tokens(b)
            )
        else:
            lr_ = c - p
        r = math.exp(lr_)
        rc = min(max(r, 1 - cfg.ratio_clip_min), 1 + cfg.ratio_clip_max)
        if cfg.disable_ppo_ratio:
            actor = -a * c
        elif cfg.cispo:
            actor = -a * rc * c
        else:
            actor = max(-a * r, -a * rc)
            if cfg.ratio_clip_c is not None and a < 0:
                actor = min(actor, -a * cfg.ratio_clip_c)
        w = 1.0
        if cfg.use_importance_sampling_correction:
            w = math.exp(f("prev_logprobs", b, t) - f("generation_logprobs", b, t))
            kind = cfg.truncated_importance_sampling_type
            if kind == "tis":
                w = min(max(w, lo), hi)
            elif kind == "icepop":
                w = w if lo <= w <= hi else 0.0
            elif kind == "seq-mask-tis":
                us = seq_tokens(b)
                geo = math.exp(
                    sum(f("prev_logprobs", b, u) - f("generation_logprobs", b, u) for u in us)
                    / len(us)
                )
                w = w if lo <= geo <= hi else 0.0
        total = w * actor
        if cfg.reference_policy_kl_penalty > 0:
            logr = min(max(f("reference_policy_logprobs", b, t) - c, -20.0), 20.0)
            kl = {"k1": -logr, "k2": logr * logr / 2, "k3": math.exp(logr) - 1 - logr}[
                cfg.reference_policy_kl_type
            ]
            kl = min(max(kl, -10.0), 10.0)
            total += cfg.reference_policy_kl_penalty * w * kl
        per_tok[(b, t)] = total
    if cfg.token_level_loss:
        loss = sum(per_tok.values()) / n_tok
    else:
        seqs = sorted({b for b, _ in toks})
        loss = (
            sum(sum(per_tok[(b, t)] for t in seq_tokens(b)) / len(seq_tokens(b)) for b in seqs) / 2
        )
    if cfg.positive_example_nll_coef is not None:
        pos = [(b, t) for b, t in toks if sum(f("advantages", b, u) for u in seq_tokens(b)) > 0]
        loss += cfg.positive_example_nll_coef * -sum(float(curr[b, t]) for b, t in pos) / n_tok
    return loss


OPTIONS = {
    "default": ClippedPGConfig(),
    "asym-clip": ClippedPGConfig(ratio_clip_min=0.1, ratio_clip_max=0.28),
    "dual-clip": ClippedPGConfig(ratio_clip_c=1.5, ratio_clip_min=0.05),
    "no-ratio": ClippedPGConfig(disable_ppo_ratio=True),
    "on-policy": ClippedPGConfig(force_on_policy_ratio=True),
    "cispo": ClippedPGConfig(cispo=True),
    "gspo": ClippedPGConfig(sequence_level_importance_ratios=True),
    "is-plain": ClippedPGConfig(use_importance_sampling_correction=True),
    "is-tis": ClippedPGConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio_min=0.5,
        truncated_importance_sampling_ratio_max=1.2,
    ),
    "is-icepop": ClippedPGConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio_min=0.5,
        truncated_importance_sampling_ratio_max=1.2,
    ),
    "is-seq-mask": ClippedPGConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio_min=0.8,
        truncated_importance_sampling_ratio_max=1.25,
    ),
    "kl-k1": ClippedPGConfig(reference_policy_kl_type="k1", reference_policy_kl_penalty=0.1),
    "kl-k2": ClippedPGConfig(reference_policy_kl_type="k2", reference_policy_kl_penalty=0.1),
    "kl-k3": ClippedPGConfig(reference_policy_kl_type="k3", reference_policy_kl_penalty=0.1),
    "no-kl": ClippedPGConfig(reference_policy_kl_penalty=0.0),
    "sequence-level": ClippedPGConfig(token_level_loss=False),
    "positive-nll": ClippedPGConfig(positive_example_nll_coef=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_clipped_pg_matches_hand_computation(name):
    cfg = OPTIONS[name]
    curr, data = _batch()
    toks, seqs = torch.tensor(float(len(_tokens(data)))), torch.tensor(2.0)
    loss, metrics = ClippedPGLoss(cfg)(curr, data, global_valid_seqs=seqs, global_valid_toks=toks)
    assert loss.item() == pytest.approx(_hand(cfg, curr, data), rel=1e-5, abs=1e-6)
    assert metrics["loss"].item() == pytest.approx(loss.item())


def test_ppo_surrogate_literal_values():
    # A = 1, r = e^0.5 -> clipped to 1.2: surrogate -1.2. A = -1, r = e^-0.5 -> max(0.6065, 0.8) = 0.8.
    curr = torch.tensor([[0.0, -0.5], [0.0, -1.5]])
    data = BatchedDataDict(
        token_mask=torch.ones(2, 2),
        sample_mask=torch.ones(2),
        advantages=torch.tensor([[0.0, 1.0], [0.0, -1.0]]),
        prev_logprobs=torch.tensor([[0.0, -1.0], [0.0, -1.0]]),
        generation_logprobs=torch.tensor([[0.0, -1.0], [0.0, -1.0]]),
    )
    cfg = ClippedPGConfig(reference_policy_kl_penalty=0.0)
    loss, m = ClippedPGLoss(cfg)(
        curr, data, global_valid_seqs=torch.tensor(2.0), global_valid_toks=torch.tensor(2.0)
    )
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, rel=1e-6)
    assert m["clipped_fraction"].item() == pytest.approx(1.0)
    assert m["probs_ratio"].item() == pytest.approx((math.exp(0.5) + math.exp(-0.5)) / 2, rel=1e-6)
    assert m["token_mult_prob_error"].item() == pytest.approx(1.0)


def test_gradients_of_cispo_and_on_policy():
    curr, data = _batch()
    toks = torch.tensor(float(len(_tokens(data))))
    for cfg in (
        ClippedPGConfig(cispo=True, reference_policy_kl_penalty=0.0),
        ClippedPGConfig(force_on_policy_ratio=True, reference_policy_kl_penalty=0.0),
    ):
        x = curr.clone().requires_grad_(True)
        loss, _ = ClippedPGLoss(cfg)(
            x, data, global_valid_seqs=torch.tensor(2.0), global_valid_toks=toks
        )
        loss.backward()
        expected = torch.zeros_like(curr)
        for b, t in _tokens(data):
            a = float(data["advantages"][b, t])
            if cfg.cispo:
                r = math.exp(float(curr[b, t] - data["prev_logprobs"][b, t]))
                expected[b, t] = -a * min(max(r, 0.8), 1.2) / toks
            else:
                expected[b, t] = -a / toks
        assert torch.allclose(x.grad, expected, atol=1e-6)


def test_kl_weight_gives_score_function_gradient():
    # d/dcurr [k3 * exp(curr - sg(curr))] = k3 + dk3/dcurr at the same point.
    curr = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -0.5]])
    from policyworker.losses.clipped_pg import kl_estimate

    kl = kl_estimate(curr, ref, ClippedPGConfig())
    kl[0, 1].backward()
    logr = 0.5
    k3 = math.exp(logr) - 1 - logr
    dk3 = -(math.exp(logr) - 1)
    assert curr.grad[0, 1].item() == pytest.approx(k3 + dk3, rel=1e-6)


def test_seq_logprob_error_threshold_drops_sequences():
    _, data = _batch()
    loss_fn = ClippedPGLoss(ClippedPGConfig(seq_logprob_error_threshold=2.0))
    out = loss_fn.prepare_batch(data)
    # sequence 0 has a token with |gen - prev| = 2.9 -> mean exp error 5.5 > 2; sequence 1 (1.7) stays.
    assert out["sample_mask"].tolist() == [0.0, 1.0]
    assert data["sample_mask"].tolist() == [1.0, 1.0]  # input untouched


def test_nll_and_masked_mean():
    curr, data = _batch()
    toks = _tokens(data)
    loss, _ = NLLLoss()(
        curr, data, global_valid_seqs=torch.tensor(2.0), global_valid_toks=torch.tensor(10.0)
    )
    assert loss.item() == pytest.approx(-sum(float(curr[b, t]) for b, t in toks) / 10.0, rel=1e-6)
    assert masked_mean(torch.ones(3), torch.tensor([1.0, 0.0, 1.0]), 4.0).item() == pytest.approx(
        0.5, rel=1e-6
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio_clip_c": 1.0},
        {"reference_policy_kl_type": "k4"},
        {"truncated_importance_sampling_type": "x"},
        {"ratio_clip_min": -0.1},
        {"cispo": True, "disable_ppo_ratio": True},
    ],
)
def test_bad_loss_options_raise(kwargs):
    with pytest.raises(ValueError):
        ClippedPGConfig(**kwargs)
