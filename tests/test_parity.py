"""Logprobs and top-k equal transformers' on the same weights (fp32, max abs diff <= 1e-4)."""

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import hf_logprobs, make_batch, make_hf_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

YARN_ROPE = {  # Qwen3's long-context recipe: cos/sin scaled by 0.1 ln(factor) + 1
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 1e6,
}

CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3-rope": (
        "llama",
        {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
    ),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-yarn": ("qwen3", {"rope_scaling": YARN_ROPE}),
    "mistral": ("mistral", {"rope_theta": 1e6}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers(tmp_path, case, temperature):
    arch, overrides = CASES[case]
    folder = make_hf_model(tmp_path, arch, **overrides)
    worker = make_worker(folder, temperature=temperature, logprob_batch_size=3)
    data = make_batch(batch=5, seq=20, lengths=[20, 7, 13, 1, 16])
    ours = worker.get_logprobs(data=data)["logprobs"]
    ref = hf_logprobs(folder, data, temperature=temperature)
    assert ours.shape == (5, 20) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (ours[:, 0] == 0).all()
    assert (ours[1, 7:] == 0).all() and (ours[3, 1:] == 0).all()


def test_logprobs_do_not_depend_on_micro_batch_size(llama_dir):
    worker = make_worker(llama_dir)
    data = make_batch(batch=6, seq=16)
    a = worker.get_logprobs(data=data, micro_batch_size=1)["logprobs"]
    b = worker.get_logprobs(data=data, micro_batch_size=6)["logprobs"]
    assert (a - b).abs().max().item() <= 1e-5


def test_topk_matches_transformers(llama_dir):
    worker = make_worker(llama_dir, temperature=0.5)
    data = make_batch(batch=3, seq=10, lengths=[10, 4, 8])
    out = worker.get_topk_logits(data=data, k=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    with torch.no_grad():
        logits = model(data["input_ids"]).logits / 0.5
    vals, idx = logits.topk(4, dim=-1)
    valid = torch.arange(10)[None, :] < data["input_lengths"][:, None]
    assert out["topk_logits"].shape == (3, 10, 4)
    assert (out["topk_logits"] - vals * valid[..., None]).abs().max() <= 1e-4
    assert torch.equal(out["topk_indices"][valid], idx[valid])
    assert (out["topk_indices"][~valid] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_values_and_gradient(llama_dir, temperature, dtype):
    """Against float64 autograd of log_softmax: values and the gradient w.r.t. the logits."""
    from logit_ops import token_logprobs

    dev = make_worker(llama_dir).device  # sets up torch.distributed and megatron's groups
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 9, 50, generator=g) * 4).to(dev, dtype).requires_grad_(True)
    ids = torch.randint(0, 50, (3, 9), generator=g).to(dev)
    weights = torch.randn(3, 9, generator=g).to(dev)
    ours = token_logprobs(logits, ids, temperature=temperature, tp_group=None, tp_rank=0)
    (ours * weights).sum().backward()
    ref_in = logits.detach().double().requires_grad_(True)
    ref = (
        torch.log_softmax(ref_in[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    )
    (ref * weights[:, 1:].double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (ours[:, 0] == 0).all()
    assert (ours[:, 1:].double() - ref).abs().max() <= tol
    assert logits.grad.dtype == dtype
    assert (logits.grad.double() - ref_in.grad).abs().max() <= tol
