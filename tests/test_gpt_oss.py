"""gpt-oss (attention sinks, sliding-window layers, biases on every linear layer, the clamped
SwiGLU, YaRN, experts stored fused) beyond the family checks of test_moe.py: what the shape
reads and refuses, each feature's own effect, generation, recompute. Its layouts (EP2 x TP2 +
SP packed, EP2 x CP2 packed and chunked) are test_moe.FAMILY_FOUR_RANKS."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import hf_logprobs, make_batch, make_hf_model
from test_moe import _model, _worker_grads
from test_worker_generate import response_mask, scored

from policyworker.config import RecomputeConfig
from policyworker.model.attention.core import CoreAttention
from policyworker.model.attention.masked import Causal, Masked
from policyworker.model.hf_config import UnsupportedModelError, model_shape
from policyworker.model.router_rules import Softmax


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


def _config(folder, **changes):
    config = transformers.AutoConfig.from_pretrained(folder)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_the_shape_reads_sinks_windows_and_the_clamp_and_refuses_what_is_not_built(folder):
    shape = model_shape(_config(folder))
    assert shape.windows == (5, 0, 5, 0) and shape.sinks and shape.swiglu_clamp == 7.0
    assert shape.arch.linear_bias and shape.arch.qkv_bias
    assert shape.moe.rule == Softmax(normalize=True) and shape.moe.layers == (True,) * 4
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    with pytest.raises(UnsupportedModelError, match="quant_method='mxfp4'"):
        model_shape(_config(folder, quantization_config=mxfp4))
    with pytest.raises(UnsupportedModelError, match=r"swiglu_limit=10\.0"):
        model_shape(_config(folder, swiglu_limit=10.0))
    with pytest.raises(UnsupportedModelError, match="attention_bias=False"):
        model_shape(_config(folder, attention_bias=False))
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        model_shape(_config(folder, layer_types=["chunked_attention"] * 4))


def test_each_layer_runs_its_own_softmax_and_each_feature_counts(folder):
    """Sliding layers reach 5 keys, full ones all; every layer has its sinks. Dropping the
    windows, the sinks or the clamp moves the logprobs far past the tolerance (so the parity
    of test_moe.py checks each)."""
    worker = make_worker(folder)
    layers = [m for m in worker.state.model.modules() if isinstance(m, CoreAttention)]
    assert all(isinstance(layer.softmax, Masked) for layer in layers)
    assert [layer.softmax.window for layer in layers] == [5, 0, 5, 0]
    assert all(layer.softmax.sinks is layer.softmax_offset for layer in layers)
    data = make_batch(batch=3, seq=20, lengths=[20, 9, 14])
    ref = hf_logprobs(folder, data)
    assert (worker.get_logprobs(data=data)["logprobs"] - ref).abs().max() <= 1e-5
    for layer in layers:
        layer.softmax.window = 0
    assert (worker.get_logprobs(data=data)["logprobs"] - ref).abs().max() > 1e-3
    for layer in layers:
        layer.softmax = Masked(0, None)
    assert (worker.get_logprobs(data=data)["logprobs"] - ref).abs().max() > 1e-2
    plain = make_worker(make_hf_model(folder.parent / "llama", "llama"))
    assert all(
        isinstance(m.softmax, Causal)
        for m in plain.state.model.modules()
        if isinstance(m, CoreAttention)
    )


def test_the_clamp_is_reached_and_counts(folder):
    """The experts' gate/up values pass the clamp at 7 for some tokens (helpers.make_hf_model
    scales them): without the clamp the logprobs move."""
    data = make_batch(batch=2, seq=16)
    worker = make_worker(folder)
    ref = worker.get_logprobs(data=data)["logprobs"]
    configs = [m.config for m in worker.state.model.modules() if hasattr(m, "config")]
    assert {c.activation_func_clamp_value for c in configs} == {7.0}
    for config in configs:
        config.activation_func_clamp_value = None
    assert (worker.get_logprobs(data=data)["logprobs"] - ref).abs().max() > 1e-3


def test_recompute_and_chunked_logprobs_equal_plain(folder):
    data = make_batch(batch=4, seq=14)
    plain = make_worker(folder)
    want = _worker_grads(plain, data)
    full = RecomputeConfig(activation_checkpointing=True)
    for recompute in (
        full,
        RecomputeConfig(activation_checkpointing=True, recompute_granularity="selective"),
    ):
        got = _worker_grads(make_worker(folder, recompute=recompute), data)
        assert got.keys() == want.keys()
        for name, g in want.items():  # gradients' tolerance (the clamped SwiGLU's large
            # values; SDPA's kernel differs between a recompute's gradient-free pass and its own)
            scale = g.abs().max().clamp_min(1e-8)
            assert ((got[name] - g).abs().max() / scale).item() <= 1e-5, name
    chunked = make_worker(folder, logprob_chunk_size=5).get_logprobs(data=data)["logprobs"]
    assert (chunked - plain.get_logprobs(data=data)["logprobs"]).abs().max() <= 1e-6


def test_generation_equals_transformers_and_its_logprobs_are_get_logprobs(folder):
    """Prompts longer than the window, so that decode steps reach only the last 5 keys in the
    sliding layers while the full ones reach every key; the sinks in every step."""
    worker = make_worker(folder, generation={"max_new_tokens": 8, "stop_token_ids": []})
    prompts = make_batch(batch=3, seq=14, lengths=[14, 6, 11])
    out = worker.generate(data=prompts, greedy=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    hf.generation_config.eos_token_id = None
    with torch.no_grad():  # the first prompt's greedy continuation, by transformers
        drawn = hf.generate(
            prompts["input_ids"][:1], max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    assert torch.equal(out["output_ids"][0, :22], drawn[0])
    sampled = worker.generate(data=prompts, seed=5)
    mask = response_mask(sampled, [14, 6, 11])
    assert int(mask.sum()) == 24
    assert (scored(worker, sampled) - sampled["logprobs"])[mask].abs().max() <= 1e-5


def test_export_writes_the_fused_layout_transformers_reads(folder, tmp_path):
    """Trained weights exported: the experts fused as gpt-oss stores them (interleaved gate/up
    columns, transposed, biases), the sinks and o_proj's bias, reloading into transformers with
    the worker's logprobs; the config unchanged."""
    from policyworker.losses import NLLLoss

    worker = make_worker(folder)
    data = make_batch(batch=4, seq=12)
    worker.train(data, NLLLoss())
    out = worker.save_hf_pretrained(tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["layer_types"][0] == "sliding_attention"
    ours = worker.get_logprobs(data=data)["logprobs"]
    assert (hf_logprobs(out, data) - ours).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (
            lambda t: t[:7],
            r"no tensor .*experts\.7\.gate_up_proj \(expert 7 of .*experts\.gate_up_proj\)",
        ),
        (
            lambda t: t[:, :, :-2],
            r"experts\.0\.gate_up_proj \(expert 0 of .*\) has shape \[64, 62\]",
        ),
    ],
    ids=["an-expert-missing", "narrower"],
)
def test_a_fused_expert_tensor_that_disagrees_with_the_config_is_refused_up_front(
    folder, tmp_path, cut, match
):
    """Checked before any weight is read, naming the fused tensor on disk."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(folder, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = cut(tensors[name]).contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        make_worker(bad)


class _ReferenceVarlen:
    """The contract of flash's varlen pair (`sink_flash.VarlenKernel`) in plain fp64 math: the
    backward forms D_i from the `out` it is given, as flash's does."""

    def _probs(self, q, k, cu, scale, window):
        t, heads = q.shape[:2]
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        pos = torch.arange(t)
        seq = torch.bucketize(pos, cu[1:], right=True)
        ok = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
        if window:
            ok &= pos[None, :] > pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~ok, float("-inf"))
        return scores.softmax(-1), scores.logsumexp(-1).T  # [h, q, k], [t, h]

    def forward(self, q, k, v, cu, longest, scale, window):
        p, lse = self._probs(q, k, cu, scale, window)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.einsum("hqk,khd->qhd", p, v), lse, None

    def backward(self, d_o, q, k, v, out, lse, cu, longest, scale, window, saved):
        groups = q.shape[1] // k.shape[1]
        p, _ = self._probs(q, k, cu, scale, window)
        kr, vr = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        dv = torch.einsum("hqk,qhd->khd", p, d_o)
        d_p = torch.einsum("qhd,khd->hqk", d_o, vr)
        ds = p * (d_p - (d_o * out).sum(-1).T[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, kr) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
        fold = lambda x: x.reshape(x.shape[0], -1, groups, x.shape[-1]).sum(2)  # noqa: E731
        return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("window", [0, 3])
def test_sinks_through_the_log_sum_exp_equal_the_exact_masks(window):
    """The flash form of sinks (`attention/sink_flash.py`: out = o · sigmoid(lse − s), its
    backward through flash's own with D from the sink-scaled output) on a reference kernel pair
    equals `Masked`'s exact masked SDPA: outputs and the gradients of q, k, v and the sinks,
    packed sequences apart, grouped heads, with and without a window."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from policyworker.model.attention.layout import Packed
    from policyworker.model.attention.sink_flash import SinkFlash

    g = torch.Generator().manual_seed(0)
    t, cu = 22, torch.tensor([0, 5, 12, 20])  # three sequences, then 2 padding tokens
    q = torch.randn(t, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(t, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    pos = torch.cat([torch.arange(5), torch.arange(7), torch.arange(8), torch.arange(2)])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8)
    where = Packed(pos[:, None], cu, cu, params)
    rows = [x[:20].reshape(2, 10, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]  # padded
    for layout in ("packed", "padded"):
        results = []
        for make in (lambda s: Masked(window, s), lambda s: SinkFlash(window, s, None, _ReferenceVarlen())):  # fmt: skip
            leaves = [x.clone().requires_grad_() for x in (*(rows if layout == "padded" else (q, k, v)), sinks)]  # fmt: skip
            kernels = make(leaves[3])
            out = (
                kernels.padded(*leaves[:3], 0.3)
                if layout == "padded"
                else kernels.packed(*leaves[:3], where, 0.3)
            )
            weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
            (out * weights).sum().backward()
            results.append([out.detach(), *(x.grad for x in leaves)])
        for got, want in zip(results[1], results[0], strict=True):
            assert (got - want).abs().max() <= 1e-12, layout
