"""DeepSeek-V3 (multi-head latent attention, GLM-4.5's sigmoid routing) beyond the family checks
of test_moe.py: what it refuses by name, and its two-rank layouts."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import hf_logprobs, make_batch, make_hf_model
from test_moe import _assert_layout_matches, _model, _one_and_two_ranks
from test_worker_generate import response_mask, scored

from policyworker.model.hf_config import LatentShape, UnsupportedModelError, model_shape
from policyworker.model.router_rules import Sigmoid


def test_the_shape_reads_latent_attention_and_refuses_what_is_not_built(tmp_path):
    shape = model_shape(transformers.AutoConfig.from_pretrained(_model(tmp_path, "deepseek_v3")))
    assert shape.latent == LatentShape(
        q_lora_rank=32, kv_lora_rank=16, nope_dim=16, rope_dim=8, v_dim=16, interleaved=True
    )
    assert (shape.head_dim, shape.num_kv_heads, shape.rotary_offset, shape.rotary_dim) == (
        24,
        4,
        16,
        8,
    )
    assert shape.moe.rule == Sigmoid(groups=4, group_topk=2, scale=2.5)
    assert shape.moe.layers == (False, True) and not shape.moe.shared_expert_gate
    no_q_latent = transformers.DeepseekV3Config(q_lora_rank=None)
    no_q_latent.architectures = ["DeepseekV3ForCausalLM"]
    assert model_shape(no_q_latent).latent.q_lora_rank == 0  # one q_proj (test_moe.FAMILIES)
    dynamic = dict(rope_type="dynamic", factor=4.0, rope_theta=1e4)
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        make_worker(make_hf_model(tmp_path / "dynamic", "deepseek_v3", rope_parameters=dynamic))
    with pytest.raises(ValueError, match="batch_invariant: not supported yet"):
        make_worker(_model(tmp_path / "inv", "deepseek_v3"), batch_invariant=True)
    worker = make_worker(_model(tmp_path / "fp8", "deepseek_v3"))
    with pytest.raises(ValueError, match="not supported for multi-head latent attention"):
        worker.calibrate_qkv_fp8_scales(data=make_batch(batch=2, seq=8))


def test_a_checkpoint_with_rope_halves_loads_and_exports_exactly(tmp_path):
    """`rope_interleave: false`: its RoPE rows are interleaved on load (megatron's MLA reads
    pairs) and taken apart again on export."""
    from safetensors.torch import load_file

    folder = make_hf_model(tmp_path / "halves", "deepseek_v3", rope_interleave=False)
    worker = make_worker(folder)
    data = make_batch(batch=3, seq=12, lengths=[12, 5, 9])
    ours = worker.get_logprobs(data=data)["logprobs"]
    assert (ours - hf_logprobs(folder, data)).abs().max().item() <= 1e-5
    saved = load_file(worker.save_hf_pretrained(tmp_path / "export") / "model.safetensors")
    original = load_file(folder / "model.safetensors")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[n], original[n]) for n in original)


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3-no-query-latent"])
def test_generation_caches_latents_and_its_logprobs_are_get_logprobs(tmp_path, monkeypatch, case):
    """The KV cache holds [latent, RoPE key] per token and layer (kv_lora_rank + rope_dim = 24
    numbers here, not heads x (key + value width) = 4 x 40) and the latents are a view of it; the
    absorbed decode steps give the per-head form's logprobs: sampled rows of different prompt
    lengths score as `get_logprobs` scores them."""
    import contextlib

    from policyworker.model.attention.latent_cache import LatentCache

    worker = make_worker(
        _model(tmp_path, case), generation={"max_new_tokens": 8, "stop_token_ids": []}
    )
    paths, caches = worker.scorer.paths, []
    generating = paths.generating

    @contextlib.contextmanager
    def keeping(model, capacity):
        with generating(model, capacity) as phase:
            yield phase
            caches.append(phase.cache)

    monkeypatch.setattr(paths, "generating", keeping)
    lengths = [9, 4, 12]
    data = make_batch(batch=3, seq=12, lengths=lengths)
    out = worker.generate(data=data, seed=3)
    (cache,) = caches
    assert isinstance(cache, LatentCache) and sorted(cache.layers) == [1, 2]
    keys, latents = cache.layers[1]
    assert keys.shape[1] == 1 and keys.shape[-1] == 16 + 8 and latents.shape[-1] == 16
    assert latents.data_ptr() == keys.data_ptr()
    mask = response_mask(out, lengths)
    assert int(mask.sum()) == 24
    assert (scored(worker, out) - out["logprobs"])[mask].abs().max() <= 1e-5


# DeepSeek-V3's and Kimi-K2's long-context RoPE: YaRN frequencies, cos/sin scaled by
# mscale / mscale_all_dim's ratio, and the softmax by mscale_all_dim's mscale squared
YARN = dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=1e4,
    mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1,
)  # fmt: skip


def test_yarn_logprobs_and_generation_equal_transformers(tmp_path):
    folder = make_hf_model(tmp_path / "yarn", "deepseek_v3", rope_parameters=YARN)
    shape = model_shape(transformers.AutoConfig.from_pretrained(folder))
    assert shape.latent is not None and shape.latent.mscale == (4.0, 0.8)
    worker = make_worker(folder, generation={"max_new_tokens": 6, "stop_token_ids": []})
    data = make_batch(batch=3, seq=40, lengths=[40, 17, 29])
    ours = worker.get_logprobs(data=data)["logprobs"]
    assert (ours - hf_logprobs(folder, data)).abs().max().item() <= 1e-5
    prompts = make_batch(batch=2, seq=30, lengths=[30, 21])
    out = worker.generate(data=prompts, greedy=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():  # the first prompt's greedy continuation, by transformers
        drawn = hf.generate(
            prompts["input_ids"][:1], max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert torch.equal(out["output_ids"][0, :36], drawn[0])
    decoded = (scored(worker, out) - out["logprobs"])[0, 30:36]
    assert decoded.abs().max() <= 1e-5  # the decode's RoPE too


DEEPSEEK_LAYOUTS = {  # latent attention's projections under TP (the down-projections gathered),
    # its RoPE at the layout's positions under CP and packing; the routing as GLM-4.5's. PP2
    # splits the layers whole, which attention does not meet: GLM-4.5's PP2 (a dense stage
    # and an MoE one) is the families' (test_glm.py); EP2 x TP2 in test_moe.FAMILY_FOUR_RANKS
    "tp2-sequence-parallel-packed-seq-aux-loss": (2, 1, ("sp", "pack", "seqaux", "bias")),
    "cp2-packed-chunked-replay": (1, 1, ("cp", "pack", "chunk", "replay", "bias")),
}


@pytest.fixture(scope="module")
def deepseek_layouts(tmp_path_factory):
    from test_parallel import VOCAB

    folder = make_hf_model(tmp_path_factory.mktemp("deepseek"), "deepseek_v3", vocab_size=VOCAB)
    out = tmp_path_factory.mktemp("deepseek_two_ranks")
    return _one_and_two_ranks(folder, DEEPSEEK_LAYOUTS, out, bias=True)


@pytest.mark.processes
@pytest.mark.parametrize("layout", DEEPSEEK_LAYOUTS)
def test_deepseek_layouts_match_one_rank(deepseek_layouts, layout):
    _assert_layout_matches(deepseek_layouts, DEEPSEEK_LAYOUTS, layout)
