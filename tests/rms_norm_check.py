"""Runs `ops.rms_norm`'s Triton kernels in Triton's interpreter (on the CPU, numpy) against the
torch ops (`reference`), forward and backward, one JSON line. Run by `test_rms_norm.py` with
TRITON_INTERPRET=1 (Triton reads it when the kernels are defined: a process of its own)."""

from __future__ import annotations

import json

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch

from policyworker.ops import rms_norm


def _compare(x: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    """Max |ours - torch's| of the output and of both gradients, relative to torch's largest."""
    grad = torch.randn(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    results = []
    for fn in (rms_norm._RMSNorm.apply, rms_norm.reference):
        xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
        y = fn(xs, ws, 1e-6)
        y.backward(grad)
        results.append((y.detach().float(), xs.grad.float(), ws.grad.float()))
    (y, dx, dw), (ry, rdx, rdw) = results
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return {
        "y": rel(y, ry),
        "dx": rel(dx, rdx),
        "dw": rel(dw, rdw),
        "dtype_ok": y.dtype == ry.dtype,
    }


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, object] = {}
    # rows not a multiple of a tile, a width not a power of two
    out["fp32"] = _compare(torch.randn(37, 3, 200), torch.randn(200))
    # the key heads of a fused QKV output: a strided view that flattens without a copy
    qkv = torch.randn(5, 2, 4, 6 * 16)
    out["fp32_view"] = _compare(qkv[..., 4 * 16 : 5 * 16], torch.randn(16))
    # rows that do not flatten (a transpose): copied, same numbers
    out["fp32_transposed"] = _compare(torch.randn(24, 7).t(), torch.randn(24))
    # bf16 activations and weights; fp32 weights on bf16 activations promote the output
    out["bf16"] = _compare(torch.randn(33, 128).bfloat16(), torch.randn(128).bfloat16())
    out["mixed"] = _compare(torch.randn(9, 64).bfloat16(), torch.randn(64))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
