"""Router replay (#27, R3): MoE routers take the experts a generation engine chose
(`routed_experts` [B, S, L, K]); get_logprobs returns the routes it used."""

from __future__ import annotations

import pytest
import torch
from conftest import make_worker
from helpers import make_batch, make_hf_model

from policyworker.config import MoEConfig, RecomputeConfig, SequencePackingConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import BatchValidationError
from policyworker.losses import NLLLoss

ROUTES = "routed_experts"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    # qwen3_moe: layer 0 dense, layer 1 MoE (8 experts, top-2)
    return make_hf_model(tmp_path_factory.mktemp("replay"), "qwen3_moe")


def _replaying(folder, **overrides):
    return make_worker(folder, moe=MoEConfig(router_replay=True), **overrides)


def _with(data: BatchedDataDict, routes: torch.Tensor) -> BatchedDataDict:
    return BatchedDataDict({**data, ROUTES: routes})


def _perturb_routers(worker, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in worker.state.model.named_parameters():
            if ".router." in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def _own(worker, data):
    return worker.get_logprobs(data=data, require_router_replay=False, return_routes=True)


def test_the_routes_used_come_back_and_replaying_them_changes_nothing(moe_dir):
    """[B, S, L, K] with -1 past each length; replayed, the same logprobs and the same routes."""
    worker = _replaying(moe_dir)
    data = make_batch(batch=4, seq=12)
    own = _own(worker, data)
    routes = own[ROUTES]
    assert routes.shape == (4, 12, 1, 2) and routes.dtype == torch.int64
    valid = torch.arange(12)[None, :] < data["input_lengths"][:, None]
    assert (routes[~valid] == -1).all() and ((routes[valid] >= 0) & (routes[valid] < 8)).all()
    again = worker.get_logprobs(data=_with(data, routes), return_routes=True)
    assert torch.equal(again["logprobs"], own["logprobs"])
    assert torch.equal(again[ROUTES], routes)


def test_replay_overrides_perturbed_routers_and_minus_one_falls_back(moe_dir):
    """After the routers' weights change, they choose other experts; replayed, every token goes
    to its recorded experts, except rows of -1, which get the routers' new choice."""
    worker = _replaying(moe_dir)
    data = make_batch(batch=4, seq=12)
    routes = _own(worker, data)[ROUTES]
    _perturb_routers(worker)
    now = _own(worker, data)[ROUTES]
    assert (now != routes).any()
    replayed = worker.get_logprobs(data=_with(data, routes), return_routes=True)[ROUTES]
    assert torch.equal(replayed, routes)
    partial = routes.clone()
    partial[:, ::2] = -1  # every other position left to the routers
    mixed = worker.get_logprobs(data=_with(data, partial), return_routes=True)
    want = torch.where(partial >= 0, routes, now)
    assert torch.equal(mixed[ROUTES], want)
    nothing = worker.get_logprobs(data=_with(data, torch.full_like(routes, -1)))
    assert torch.equal(nothing["logprobs"], _own(worker, data)["logprobs"])


@pytest.mark.parametrize("layout", ["packed", "one-row-micro-batches"])
def test_routes_follow_their_tokens_through_packing_and_micro_batches(moe_dir, layout):
    """Routes recorded padded with 2-row micro-batches, replayed by a worker whose routers were
    perturbed and which packs (or runs one row at a time): the same routes and logprobs."""
    data = make_batch(batch=4, seq=12)
    reference = _replaying(moe_dir)
    want = _own(reference, data)
    packing = SequencePackingConfig(enabled=layout == "packed", logprob_mb_tokens=20)
    worker = _replaying(moe_dir, sequence_packing=packing)
    _perturb_routers(worker, scale=1e-3)  # the experts' numbers stay; the routes would move
    mbs = 1 if layout == "one-row-micro-batches" else None
    got = worker.get_logprobs(data=_with(data, want[ROUTES]), micro_batch_size=mbs)
    routes = worker.get_logprobs(
        data=_with(data, want[ROUTES]), micro_batch_size=mbs, return_routes=True
    )[ROUTES]
    assert torch.equal(routes, want[ROUTES])
    assert (got["logprobs"] - want["logprobs"]).abs().max().item() <= 1e-2


@pytest.mark.parametrize(
    "recompute",
    [RecomputeConfig(), RecomputeConfig(activation_checkpointing=True)],
    ids=["plain", "full-recompute"],
)
def test_training_replays_the_routes_in_every_forward(moe_dir, recompute):
    """Two replayed train steps with perturbed routers: the same loss and grad norm with and
    without activation recompute (the recomputed forwards replay too), the differing-route
    fraction reported, and the routes after them still the recorded ones."""
    data = make_batch(batch=4, seq=12)
    routes = _own(_replaying(moe_dir), data)[ROUTES]
    out = []
    for cfg in (RecomputeConfig(), recompute):
        worker = _replaying(moe_dir, recompute=cfg)
        _perturb_routers(worker)
        steps = [worker.train(_with(data, routes), NLLLoss()) for _ in range(2)]
        after = worker.get_logprobs(data=_with(data, routes), return_routes=True)
        out.append((steps, after))
        worker.shutdown()
    (plain, _), (steps, after) = out
    for a, b in zip(plain, steps, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert 0 < b["moe_replay_route_differs_fraction"] <= 1
        assert b["moe_replay_route_differs_fraction"] == a["moe_replay_route_differs_fraction"]
    assert torch.equal(after[ROUTES], routes)


def test_unperturbed_replay_differs_nowhere(moe_dir):
    worker = _replaying(moe_dir)
    data = make_batch(batch=4, seq=12)
    routes = _own(worker, data)[ROUTES]
    metrics = worker.train(_with(data, routes), NLLLoss())
    assert metrics["moe_replay_route_differs_fraction"] == 0.0


def _bad(routes: torch.Tensor, how: str) -> torch.Tensor:
    bad = routes.clone()
    if how == "shape":
        return bad[:, :, :, :1]
    if how == "range":
        bad[0, 0, 0, 0] = 8
    elif how == "partial":
        bad[0, 0, 0, 0] = -1
    elif how == "repeated":
        bad[0, 0, 0, 1] = bad[0, 0, 0, 0]
    elif how == "float":
        return bad.float()
    return bad


@pytest.mark.parametrize("how", ["missing", "shape", "range", "partial", "repeated", "float"])
def test_bad_routes_are_refused_naming_the_field_and_change_nothing(moe_dir, how):
    worker = _replaying(moe_dir)
    data = make_batch(batch=4, seq=12)
    routes = _own(worker, data)[ROUTES]
    batch = data if how == "missing" else _with(data, _bad(routes, how))
    before = {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}
    for call in (
        lambda: worker.get_logprobs(data=batch),
        lambda: worker.train(batch, NLLLoss()),
    ):
        with pytest.raises(BatchValidationError, match=ROUTES):
            call()
    for n, p in worker.state.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not worker.trainer.step_open


def test_reference_logprobs_do_not_replay_and_need_no_routes(moe_dir):
    worker = _replaying(moe_dir)
    data = make_batch(batch=4, seq=12)
    ref = worker.get_reference_policy_logprobs(data=data)["reference_logprobs"]
    assert torch.equal(ref, _own(worker, data)["logprobs"])


def test_replay_and_routes_need_experts(llama_dir):
    with pytest.raises(ValueError, match=r"moe\.router_replay"):
        make_worker(llama_dir, moe=MoEConfig(router_replay=True))
    dense = make_worker(llama_dir)
    with pytest.raises(ValueError, match="return_routes"):
        dense.get_logprobs(data=make_batch(batch=2, seq=6), return_routes=True)


def test_the_references_key_maps_to_router_replay():
    from policyworker.config.nemo_rl import policy_dict

    section = {
        "model_name": "/ckpt",
        "megatron_cfg": {"enabled": True},
        "router_replay": {"enabled": True},
    }
    assert policy_dict({"policy": section}, ignore_unsupported=False)["moe"]["router_replay"]
