"""Activation recompute (#28, with the reference's keys): megatron recomputes each layer (full) or
the named modules (selective) in the backward; gradients, steps and metrics stay the same."""

from __future__ import annotations

import pytest
from conftest import make_worker
from helpers import make_batch, make_hf_model
from test_moe import _worker_grads

from policyworker.config import RecomputeConfig, SequencePackingConfig
from policyworker.losses import NLLLoss
from policyworker.model.attention.core import CoreAttention

RECOMPUTE = {
    "off": RecomputeConfig(),
    "full": RecomputeConfig(activation_checkpointing=True),
    # both layers in one checkpoint; only the first layer recomputed
    "uniform-2": RecomputeConfig(activation_checkpointing=True, recompute_num_layers=2),
    "block-1": RecomputeConfig(activation_checkpointing=True, recompute_method="block"),
    "selective": RecomputeConfig(
        activation_checkpointing=True,
        recompute_granularity="selective",
        recompute_modules=["core_attn", "mlp", "moe"],
    ),
}


@pytest.mark.parametrize(
    ("arch", "packed"),
    [("qwen2", False), ("qwen2", True), ("qwen3_moe", False), ("qwen3_moe", True),
     ("glm4_moe", True), ("deepseek_v3", True)],  # the new families: the packed path only
    ids=lambda v: {False: "rows", True: "packed"}.get(v, v),
)  # fmt: skip
def test_recompute_gives_the_same_gradients(tmp_path, arch, packed):
    """Gradients of a split step's chunk (fp32 CPU) with full (uniform over single layers or two,
    block over the first layer) and selective recompute equal those without, within 1e-6 of each
    tensor's largest; the recompute really ran (each recomputed layer's attention forward
    twice)."""
    folder = make_hf_model(tmp_path / "m", arch)
    data = make_batch(batch=4, seq=12)
    packing = SequencePackingConfig(enabled=packed, train_mb_tokens=24)
    grads, calls = {}, {}
    for name, recompute in RECOMPUTE.items():
        worker = make_worker(folder, recompute=recompute, sequence_packing=packing)
        count = _count_attention_forwards(worker)
        grads[name], calls[name] = _worker_grads(worker, data), count[0]
        worker.shutdown()
    assert calls["full"] == calls["selective"] == calls["uniform-2"] == 2 * calls["off"] > 0
    assert 2 * calls["block-1"] == 3 * calls["off"]  # one of the two layers
    for name in RECOMPUTE:
        for key, want in grads["off"].items():
            scale = want.abs().max().clamp_min(1e-8)
            assert ((grads[name][key] - want).abs().max() / scale).item() <= 1e-6, (name, key)


def _count_attention_forwards(worker) -> list[int]:
    """A one-item list that counts the forwards of every core attention module from now on."""
    count = [0]

    def hook(*_: object) -> None:
        count[0] += 1

    for module in worker.state.model.modules():
        if isinstance(module, CoreAttention):
            module.register_forward_hook(hook)
    return count


def test_train_steps_with_recompute_match_and_count_each_token_once(tmp_path):
    """Two train() steps of an MoE model: the same loss, grad norm, tokens-per-expert figures
    (the recompute's second router pass is not counted) and logprobs after, with and without."""
    folder = make_hf_model(tmp_path / "m", "qwen3_moe")
    data = make_batch(batch=4, seq=12)
    out = {}
    for name in ("off", "full"):
        worker = make_worker(folder, recompute=RECOMPUTE[name])
        steps = [worker.train(data, NLLLoss()) for _ in range(2)]
        out[name] = steps, worker.get_logprobs(data=data)["logprobs"]
        worker.shutdown()
    (off, lp_off), (full, lp_full) = out["off"], out["full"]
    for a, b in zip(off, full, strict=True):
        for key in ("loss", "grad_norm", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key
    assert (lp_full - lp_off).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"recompute_granularity": "block"}, r"recompute\.recompute_granularity: expected full or"),
        ({"recompute_modules": ["layernorm"]}, r"recompute\.recompute_modules: expected null or"),
        ({"activation_checkpointing": 1}, r"recompute\.activation_checkpointing: expected true"),
        ({"recompute_method": "all"}, r"recompute\.recompute_method: expected uniform or block"),
        ({"recompute_num_layers": 0}, r"recompute\.recompute_num_layers: expected an int >= 1"),
    ],
)
def test_recompute_options_are_checked(change, match):
    with pytest.raises(ValueError, match=match):
        RecomputeConfig(**change).validate()


def test_more_layers_per_checkpoint_than_a_stage_holds_is_refused(llama_dir):
    """Up front, naming the key (the model has 2 layers), before any worker is built."""
    from policyworker.config import ParallelConfig
    from policyworker.model.hf_config import load_hf_config, model_shape
    from policyworker.model.layout_checks import check_layout

    shape = model_shape(load_hf_config(llama_dir))
    too_many = RecomputeConfig(activation_checkpointing=True, recompute_num_layers=3)
    with pytest.raises(ValueError, match=r"recompute\.recompute_num_layers: expected at most"):
        check_layout(ParallelConfig(), shape, None, too_many)
    check_layout(ParallelConfig(), shape, None, RecomputeConfig(recompute_num_layers=3))  # off


def test_the_references_keys_map_to_recompute():
    from policyworker.config.nemo_rl import policy_dict

    section = {
        "model_name": "/ckpt",
        "megatron_cfg": {
            "enabled": True,
            "activation_checkpointing": True,
            "recompute_granularity": "selective",
            "recompute_modules": ["moe"],
        },
    }
    got = policy_dict({"policy": section}, ignore_unsupported=False)["recompute"]
    assert got == {
        "activation_checkpointing": True,
        "recompute_granularity": "selective",
        "recompute_modules": ["moe"],
    }
