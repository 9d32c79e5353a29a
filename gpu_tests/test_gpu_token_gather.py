"""Moving MoE tokens with gathers (`ops.token_gather`) on the GPU: the Triton sum bitwise equal
to the torch sum the CPU runs, and an MoE layer whose forward and backward repeat bitwise (no
atomic adds left in its dispatcher).

python -m pytest -q gpu_tests/test_gpu_token_gather.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import make_hf_model
from test_gpu_parity import MEDIUM, _worker

from policyworker.ops import token_gather

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4096, 8, 2048), (77, 3, 1500)])
def test_kernel_sum_is_bitwise_the_torch_sum(dtype, shape):
    tokens, k, hidden = shape
    torch.manual_seed(0)
    src = torch.randn(tokens * k, hidden, device="cuda").to(dtype)
    slots = torch.randperm(tokens * k, device="cuda").view(tokens, k)
    ours = token_gather.sum_slots(src, slots)
    assert ours.dtype == dtype
    assert torch.equal(ours, token_gather._torch_sum(src, slots))


def test_moe_layer_repeats_bitwise(tmp_path):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    worker = _worker(make_hf_model(tmp_path, "qwen2_moe", **MEDIUM), "bfloat16")
    layer = next(m for m in worker.state.model.modules() if isinstance(m, MoELayer))
    hidden = torch.randn(300, 2, 256, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        leaf = hidden.clone().requires_grad_()
        out = layer(leaf)[0]
        out.float().square().sum().backward()
        runs.append((out.detach(), leaf.grad))
    for out, grad in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(grad, runs[0][1])
