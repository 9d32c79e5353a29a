"""GLM-4.5's paths beyond the family checks of test_moe.py (a file of its own: the suite runs a
file on one worker, and test_moe.py is the longest): its expert bias moving by its rule and
resuming, and its two-rank layouts."""

from __future__ import annotations

import pytest
import torch
from conftest import make_worker
from helpers import make_batch, make_hf_model
from test_moe import _assert_layout_matches, _model, _one_and_two_ranks

from policyworker.losses import NLLLoss


def _expert_biases(worker) -> list[torch.Tensor]:
    from policyworker.model.build import global_named_weights

    named = global_named_weights(worker.state.model)
    return [named[n].detach().clone() for n in sorted(named) if n.endswith("router.expert_bias")]


def test_the_expert_bias_moves_by_its_rule_and_resumes_from_a_checkpoint(tmp_path):
    """GLM-4.5's sigmoid routers: a step moves each expert's bias by `rate` towards balance
    (up where the step routed it fewer real tokens than the mean, down where more: megatron's
    aux-loss-free rule, padding not counted), the weights' optimizer never touches it, rate 0
    keeps it, and a checkpoint restores it."""
    from policyworker.config import MoEConfig

    folder, rate = _model(tmp_path, "glm4_moe"), 1e-3
    data = make_batch(batch=4, seq=12, lengths=[12, 5, 9, 3])
    still = make_worker(folder)
    start = _expert_biases(still)
    still.train(data, NLLLoss())
    assert all(torch.equal(a, b) for a, b in zip(start, _expert_biases(still), strict=True))

    worker = make_worker(folder, moe=MoEConfig(moe_router_bias_update_rate=rate))
    routes = worker.get_logprobs(data=data, return_routes=True)["routed_experts"]
    real = torch.arange(12)[None, :] < data["input_lengths"][:, None]
    worker.train(data, NLLLoss())
    moved = _expert_biases(worker)
    for layer, (before, after) in enumerate(zip(start, moved, strict=True)):
        counts = torch.bincount(routes[:, :, layer][real].reshape(-1), minlength=8).float()
        want = before + rate * torch.sign(counts.mean() - counts)
        torch.testing.assert_close(after, want, atol=1e-7, rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(start, moved, strict=True))
    worker.save_checkpoint(tmp_path / "weights", tmp_path / "optim")
    resumed = make_worker(folder, moe=MoEConfig(moe_router_bias_update_rate=rate))
    resumed.load_checkpoint(tmp_path / "weights", tmp_path / "optim")
    assert all(torch.equal(a, b) for a, b in zip(moved, _expert_biases(resumed), strict=True))


GLM_LAYOUTS = {  # GLM-4.5's sigmoid routers (group-limited, expert bias moved every step),
    # partial RoPE and ungated shared experts: what differs from Qwen2-MoE's paths, on two ranks
    "tp2-sequence-parallel-packed-replay": (2, 1, ("sp", "pack", "replay", "bias")),
    "ep2-cp2-packed-chunked-seq-aux-loss": (1, 1, ("ep", "cp", "pack", "chunk", "seqaux", "bias")),
    "pp2-split-step": (1, 2, ("split", "bias")),
}


@pytest.fixture(scope="module")
def glm_layouts(tmp_path_factory):
    from test_parallel import VOCAB

    folder = make_hf_model(tmp_path_factory.mktemp("glm"), "glm4_moe", vocab_size=VOCAB)
    out = tmp_path_factory.mktemp("glm_two_ranks")
    return _one_and_two_ranks(folder, GLM_LAYOUTS, out, bias=True)


@pytest.mark.processes
@pytest.mark.parametrize("layout", GLM_LAYOUTS)
def test_glm_layouts_match_one_rank(glm_layouts, layout):
    """GLM-4.5 in TP2+SP, EP2 x CP2 and PP2 (packed, chunked, replayed, split steps, a
    per-sequence balancing loss): the one-rank results, the expert bias moving alike in every
    layout (its token counts summed over the ranks that share the tokens)."""
    _assert_layout_matches(glm_layouts, GLM_LAYOUTS, layout)
