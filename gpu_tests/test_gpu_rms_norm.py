"""RMSNorm's Triton kernels (`ops.rms_norm`) on the GPU against the torch ops the CPU runs:
fp32 within summation order, bf16 within a rounding, forward and both gradients, on the
shapes a model gives them (hidden rows, and per-head q/k norms on views of the fused QKV).

python -m pytest -q gpu_tests/test_gpu_rms_norm.py
"""

import pytest
import torch

from policyworker.ops.rms_norm import _RMSNorm, reference

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)


def _run(fn, x, w, grad):
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(xs, ws, 1e-6)
    y.backward(grad)
    return y.float(), xs.grad.float(), ws.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["hidden", "key_heads", "odd"])
def test_kernels_equal_the_torch_ops(dtype, case):
    torch.manual_seed(0)
    if case == "hidden":
        x, w = torch.randn(2048, 2, 2048, device="cuda"), torch.randn(2048, device="cuda")
    elif case == "key_heads":  # [s, b, groups, (8 q + k + v) * 128], the key heads
        x, w = (
            torch.randn(1024, 2, 4, 10 * 128, device="cuda")[..., 1024:1152],
            torch.randn(128, device="cuda"),
        )
    else:
        x, w = torch.randn(333, 1000, device="cuda"), torch.randn(1000, device="cuda")
    x, w = x.to(dtype), w.to(dtype)
    grad = torch.randn(x.shape, device="cuda", dtype=dtype)
    ours, torchs = _run(_RMSNorm.apply, x, w, grad), _run(reference, x, w, grad)
    for name, a, b in zip(("y", "dx", "dw"), ours, torchs, strict=True):
        err = float((a - b).abs().max() / b.abs().max())
        # fp32: summation order; bf16: one rounding of the output (2^-8), more for dw's sum
        assert err <= (1e-5 if dtype == torch.float32 else 2e-2), (name, err)
