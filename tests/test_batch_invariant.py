"""`batch_invariant`: generation's logprobs are bitwise `get_logprobs` of its output (padded and
packed scoring), in Triton's interpreter; decode-step matmuls run on padded rows whose real rows
are unchanged; the setting's validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import in_interpreter, make_hf_model

from policyworker.config import PolicyConfig
from policyworker.demo.config import DemoConfig, policy_config
from policyworker.model.batch_invariant import MIN_ROWS, pad_rows


@pytest.mark.processes
def test_generation_logprobs_are_bitwise_get_logprobs(tmp_path: Path) -> None:
    folder = make_hf_model(tmp_path, "qwen3", eos_token_id=7)
    (line,) = in_interpreter("batch_invariant_check.py", folder)
    out = json.loads(line)
    for name in ("invariant", "invariant_packed"):
        assert out[name]["tokens"] >= 20
        assert out[name]["differing"] == 0, out[name]
    for name, run in out.items():
        assert run["vs_transformers"] <= 1e-5, (name, run)
    # without the setting the two paths round differently (the check can fail)
    assert out["default"]["differing"] > 0


def test_pad_rows_keeps_the_real_rows() -> None:
    x = torch.randn(3, 5, 8)
    padded = pad_rows(x)
    assert padded.shape == (MIN_ROWS, 8)
    assert torch.equal(padded[:15], x.reshape(15, 8)) and not padded[15:].any()
    big = torch.randn(MIN_ROWS + 1, 8)
    assert torch.equal(pad_rows(big), big)


def test_batch_invariant_refuses_context_parallelism() -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        PolicyConfig(model_name="m", batch_invariant=True, parallel={"context_parallel_size": 2})
    with pytest.raises(ValueError, match="batch_invariant"):
        PolicyConfig(model_name="m", batch_invariant="yes")  # type: ignore[arg-type]


def test_batch_invariant_refuses_mixture_of_experts_models(tmp_path: Path) -> None:
    """Not bitwise yet with experts (1 of 21 tokens differed in this file's check for Qwen3-MoE
    and GLM-4.5): refused by name, not run silently wrong."""
    from conftest import make_worker

    folder = make_hf_model(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match="batch_invariant: not supported yet with mixture-of"):
        make_worker(folder, batch_invariant=True)


def test_the_demo_samples_batch_invariant_in_the_workers(tmp_path: Path) -> None:
    assert policy_config(DemoConfig(engine="megatron"), tmp_path).batch_invariant
    assert not policy_config(DemoConfig(engine="megatron"), tmp_path, experts=True).batch_invariant
    assert not policy_config(DemoConfig(), tmp_path).batch_invariant
    own = DemoConfig(engine="megatron", worker={"batch_invariant": False})
    assert not policy_config(own, tmp_path).batch_invariant
