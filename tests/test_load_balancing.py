"""MoE load-balancing losses (#27): `moe_router_load_balancing_type` aux_loss (per micro-batch,
megatron's definition) and seq_aux_loss (per sequence), `moe_aux_loss_coeff`, normalized by the
step's loss tokens like the main loss."""

from __future__ import annotations

import pytest
import torch
from conftest import make_worker
from helpers import make_batch, make_hf_model
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
from test_moe import _worker_grads

from policyworker.config import MoEConfig, SequencePackingConfig
from policyworker.losses import DPOLoss, NLLLoss
from policyworker.model.balance import balance_term


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("balance"), "qwen3_moe")


def _balancing(kind: str, coeff: float = 0.1) -> MoEConfig:
    return MoEConfig(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff)


def test_one_segment_is_megatrons_aux_loss_times_its_tokens():
    """Value and gradient against megatron's `switch_load_balancing_loss_func` over the real
    tokens; padding tokens count nowhere; per segment, the sum of each segment's."""
    g = torch.Generator().manual_seed(0)
    tokens, experts, k = 20, 8, 2
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
    chosen = logits.topk(k, dim=-1).indices
    real = torch.ones(tokens, dtype=torch.bool)
    real[[3, 11, 19]] = False
    seg = torch.where(real, 0, -1)
    probs = logits.softmax(-1).requires_grad_()
    ours = balance_term(probs, chosen, seg, 1, coeff=0.3, group=None)
    per_expert = torch.zeros(experts, dtype=torch.long).index_add_(
        0, chosen[real].reshape(-1), torch.ones(int(real.sum()) * k, dtype=torch.long)
    )
    n = int(real.sum())
    probs2 = probs.detach().clone().requires_grad_()
    want = switch_load_balancing_loss_func(probs2[real], per_expert, n, k, experts, 0.3) * n
    torch.testing.assert_close(ours, want)
    (g1,) = torch.autograd.grad(ours, probs)
    (g2,) = torch.autograd.grad(want, probs2)
    torch.testing.assert_close(g1, g2)
    two = torch.where(real, torch.arange(tokens) % 2, -1)
    both = balance_term(probs, chosen, two, 2, coeff=0.3, group=None)
    parts = [
        balance_term(probs, chosen, torch.where(two == s, 0, -1), 1, coeff=0.3, group=None)
        for s in (0, 1)
    ]
    torch.testing.assert_close(both, sum(parts))


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_the_loss_reaches_the_routers_and_is_reported(moe_dir, kind):
    """Gradients change with the coefficient at the routers (and, through the routers' inputs,
    before them), not at the experts or the output layer; `moe_aux_loss` is the coefficient for
    perfectly balanced routing and above it otherwise."""
    data = make_batch(batch=4, seq=12)
    grads = {}
    for coeff in (0.0, 0.5):
        worker = make_worker(moe_dir, moe=_balancing(kind, coeff))
        grads[coeff] = _worker_grads(worker, data)
        metrics = worker.train(data, NLLLoss())
        if coeff:
            assert metrics["moe_aux_loss"] > coeff
        else:
            assert "moe_aux_loss" not in metrics
        worker.shutdown()
    for name, g in grads[0.0].items():
        changed = not torch.allclose(grads[0.5][name], g, atol=1e-7)
        if "mlp.gate." in name:
            assert changed, name
        if ".experts." in name or name == "lm_head.weight":
            assert not changed, name


@pytest.mark.parametrize("layout", ["one-row", "four-rows", "packed"])
def test_seq_aux_loss_does_not_depend_on_how_the_batch_is_cut(moe_dir, layout):
    """The same gradients (fp32, <= 1e-6 of the largest) and aux-loss figure whether each
    sequence runs alone, four to a micro-batch, or packed; aux_loss, per micro-batch, equals it
    when every micro-batch is one sequence."""
    data = make_batch(batch=4, seq=12)
    mbs = {"one-row": 1, "four-rows": 4, "packed": 4}[layout]
    packing = SequencePackingConfig(enabled=layout == "packed", train_mb_tokens=30)

    def run(kind: str, mbs: int, packing: SequencePackingConfig) -> tuple[dict, dict]:
        worker = make_worker(
            moe_dir, moe=_balancing(kind), sequence_packing=packing, train_micro_batch_size=mbs
        )
        grads = _worker_grads(worker, data, mbs=mbs)
        metrics = worker.train(data, NLLLoss())
        worker.shutdown()
        return grads, metrics

    want_grads, want = run("aux_loss", 1, SequencePackingConfig())
    grads, got = run("seq_aux_loss", mbs, packing)
    for name, g in want_grads.items():
        scale = g.abs().max().clamp_min(1e-8)
        assert ((grads[name] - g).abs().max() / scale).item() <= 1e-6, name
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key


def test_aux_loss_depends_on_the_micro_batches_by_definition(moe_dir):
    data = make_batch(batch=4, seq=12)
    figures = []
    for mbs in (1, 4):
        worker = make_worker(moe_dir, moe=_balancing("aux_loss"), train_micro_batch_size=mbs)
        figures.append(worker.train(data, NLLLoss())["moe_aux_loss"])
        worker.shutdown()
    assert figures[0] != pytest.approx(figures[1], rel=1e-3)


def test_a_streamed_step_refuses_a_loss_not_normalized_by_tokens(moe_dir):
    """DPO divides by sequences: its streamed step cannot rescale the balancing gradient (by
    loss tokens) after the fact; train() can, and runs."""
    worker = make_worker(moe_dir, moe=_balancing("seq_aux_loss"))
    with pytest.raises(ValueError, match="load-balancing"):
        worker.begin_train_step(DPOLoss())
    assert not worker.trainer.step_open
    metrics = worker.train(make_batch(batch=4, seq=12), DPOLoss())
    assert metrics["moe_aux_loss"] > 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type"),
        ({"moe_aux_loss_coeff": -0.1}, "moe_aux_loss_coeff"),
        ({"moe_aux_loss_coeff": float("nan")}, "moe_aux_loss_coeff"),
    ],
)
def test_bad_options_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**change).validate()


def test_the_references_keys_map():
    from policyworker.config.nemo_rl import policy_dict

    mcore = {
        "enabled": True,
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 0.001,
    }
    got = policy_dict(
        {"policy": {"model_name": "/m", "megatron_cfg": mcore}}, ignore_unsupported=False
    )
    assert got["moe"]["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert got["moe"]["moe_aux_loss_coeff"] == 0.001


def test_a_sigmoid_routers_balancing_probabilities_are_megatrons():
    """GLM-4.5's routers choose on sigmoid scores plus the expert bias; the loss reads the
    unbiased scores normalized over the experts, as megatron's sigmoid aux loss does."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    from policyworker.model.router_rules import Sigmoid

    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(12, 8, generator=g), 0.2 * torch.randn(8, generator=g)
    _, want = compute_routing_scores_for_aux_loss(logits, 2, "sigmoid")
    got = Sigmoid(groups=2, group_topk=1, scale=1.0).balance_probs(logits.sigmoid() + bias, bias)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_a_sigmoid_routers_loss_reaches_its_weights_and_is_reported(tmp_path, kind):
    """With the expert bias, megatron discards the values the choice returns: the loss is
    attached to the router's output weights instead, and still reaches the router."""
    folder = make_hf_model(tmp_path / "glm", "glm4_moe")
    data = make_batch(batch=4, seq=12)
    router = "model.layers.1.mlp.gate.weight"
    plain = _worker_grads(make_worker(folder), data)[router]
    worker = make_worker(folder, moe=_balancing(kind))
    balanced = _worker_grads(worker, data)[router]
    assert not torch.allclose(plain, balanced)
    assert make_worker(folder, moe=_balancing(kind)).train(data, NLLLoss())["moe_aux_loss"] > 0
