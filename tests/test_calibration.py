"""FP8 KV-cache scale calibration (#29, the seed's `calibrate_qkv_fp8_scales`) against a
brute-force computation on transformers: the keys and queries after RoPE, the values."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import make_batch

from policyworker.model.calibration import FP8_E4M3_MAX


def _hf_amax(folder, data, mbs: int) -> torch.Tensor:
    """[layers, 3] per-micro-batch maxima of |q|, |k| after RoPE and |v|, as transformers
    computes them (its apply_rotary_pos_emb and v_proj observed), one list per layer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    llama = transformers.models.llama.modeling_llama
    original = llama.apply_rotary_pos_emb
    seen: list[list[float]] = []

    def observed(q, k, *args, **kwargs):
        q, k = original(q, k, *args, **kwargs)
        seen.append([q.abs().amax().item(), k.abs().amax().item()])
        return q, k

    values: list[float] = []
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(
            lambda m, a, out: values.append(out.abs().amax().item())
        )
    llama.apply_rotary_pos_emb = observed
    try:
        with torch.no_grad():
            for start in range(0, data.size, mbs):
                model(input_ids=data["input_ids"][start : start + mbs])
    finally:
        llama.apply_rotary_pos_emb = original
    layers = len(model.model.layers)
    rows = [[*qk, v] for qk, v in zip(seen, values, strict=True)]
    return torch.tensor(rows).reshape(-1, layers, 3).transpose(0, 1)  # [layers, forwards, 3]


@pytest.mark.parametrize("percentile", [100.0, 50.0])
def test_scales_equal_transformers_amax(llama_dir, tmp_path, percentile):
    """Full-length rows (no padding), two micro-batches: per layer the percentile of the two
    micro-batches' maxima (the reference's nearest-rank rule), times the margin, over 448."""
    data = make_batch(batch=4, seq=12, lengths=[12] * 4)
    worker = make_worker(llama_dir)
    path = tmp_path / "scales.json"
    got = worker.calibrate_qkv_fp8_scales(
        data=data, micro_batch_size=2, percentile=percentile, margin=1.05, include_q=True,
        save_path=str(path),
    )  # fmt: skip
    per_forward = _hf_amax(llama_dir, data, 2)  # [layers, 2, 3]
    ordered = per_forward.sort(dim=1).values
    rank = round(percentile / 100 * (ordered.shape[1] - 1))
    want = ordered[:, rank] * 1.05 / FP8_E4M3_MAX
    assert got["format"] == "fp8" and got["percentile"] == percentile and got["margin"] == 1.05
    for i, (q, k, v) in enumerate(want.tolist()):
        layer = got["layers"]
        assert layer[f"model.layers.{i}.self_attn.attn.q_scale"] == pytest.approx(q, rel=1e-5)
        assert layer[f"model.layers.{i}.self_attn.k_scale"] == pytest.approx(k, rel=1e-5)
        assert layer[f"model.layers.{i}.self_attn.v_scale"] == pytest.approx(v, rel=1e-5)
    assert json.loads(path.read_text()) == got


def test_without_q_only_k_and_v_and_bad_options_are_refused(llama_dir):
    worker = make_worker(llama_dir)
    data = make_batch(batch=2, seq=8)
    got = worker.calibrate_qkv_fp8_scales(data=data)
    assert sorted(got["layers"]) == sorted(
        f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv"
    )
    assert all(v > 0 for v in got["layers"].values())
    for bad, match in ((dict(percentile=0), "percentile"), (dict(margin=-1.0), "margin"),
                       (dict(include_q=1), "include_q")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            worker.calibrate_qkv_fp8_scales(data=data, **bad)
