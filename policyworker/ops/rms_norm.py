"""RMSNorm with Hugging Face's arithmetic, forward and backward, as two Triton kernels on the GPU.

`rms_norm(x, weight, eps)` is `weight * (x / sqrt(mean(x²) + eps))` with the normalization in
fp32, cast back to x's dtype before the weight (`LlamaRMSNorm`), output in the promoted dtype
of the two. On the CPU it is those torch ops (exact; what the tests compare with transformers).

On the GPU each direction is one Triton launch behind an autograd Function: ~25 µs of host
time a call, where the torch.compile'd function took ~100 µs in a training forward (dynamo's
guards and AOTAutograd's wrappers; measured on an H100's host) — an MoE step's forward calls
it 25 times and waits on the host there. The backward keeps the eager graph's roundings: the
weight's product and the cast of the normalized rows to x's dtype are differentiated as
written, the normalization in fp32; the weight's gradient sums over rows in fp32.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import triton
import triton.language as tl

from policyworker.ops.compiled import multiprocessors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension (module docstring)."""
    if x.is_cuda and x.dtype != torch.float64:
        return _RMSNorm.apply(x, weight, eps)
    return reference(x, weight, eps)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch ops (`LlamaRMSNorm`'s)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@triton.jit
def _forward_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, rows, H, x_stride, eps,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    mask = (r < rows)[:, None] & (c < H)[None, :]
    r64 = r.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
    y = (normed * w[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r64 * H + c[None, :], y, mask=mask)
    tl.store(rstd_ptr + r, rstd, mask=r < rows)


@triton.jit
def _backward_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, H, x_stride,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid, programs = tl.program_id(0), tl.num_programs(0)
    c = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * ROWS, rows, programs * ROWS):
        r = start + tl.arange(0, ROWS)
        mask = (r < rows)[:, None] & (c < H)[None, :]
        r64 = r.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * x_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * H + c[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)
        xhat = x * rstd[:, None]
        normed = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        dw += tl.sum(dy * normed, axis=0)
        # the product's gradient in the product's dtype, then through the cast, in fp32
        dn = (dy * w[None, :]).to(dy_ptr.dtype.element_ty).to(tl.float32)
        dot = tl.sum(dn * xhat, axis=1) / H
        dx = rstd[:, None] * (dn - xhat * dot[:, None])
        tl.store(dx_ptr + r64 * H + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * H + c, dw, mask=c < H)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as [rows, H] rows of stride `stride` with unit column stride, without a copy where
    its leading dimensions flatten (views of megatron's fused QKV output do)."""
    h = x.shape[-1]
    lead = [(n, s) for n, s in zip(x.shape[:-1], x.stride()[:-1], strict=True) if n != 1]
    flat = x.stride(-1) == 1 and all(
        outer == inner * n_inner for (_, outer), (n_inner, inner) in itertools.pairwise(lead)
    )
    if not flat:
        x = x.contiguous()
        return x.view(-1, h), h
    stride = lead[-1][1] if lead else h
    return x.as_strided((x.numel() // h if h else 0, h), (stride, 1)), stride


def _tile(h: int) -> tuple[int, int, int]:
    """(rows per tile, the tile's padded width, warps): ~4096 elements a tile."""
    block = triton.next_power_of_2(h)
    return max(1, min(64, 4096 // block)), block, 8 if block >= 4096 else 4


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows2d, stride = _rows(x)
        n, h = rows2d.shape
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        rows_per, block, warps = _tile(h)
        if n:
            grid = (triton.cdiv(n, rows_per),)
            _forward_kernel[grid](
                rows2d, weight, y, rstd, n, h, stride, eps,
                ROWS=rows_per, BLOCK=block, num_warps=warps,
            )  # fmt: skip
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        rows2d, stride = _rows(x)
        n, h = rows2d.shape
        grad = grad.contiguous()
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rows_per, block, warps = _tile(h)
        programs = max(1, min(triton.cdiv(n, rows_per), 4 * multiprocessors(x.device)))
        partial = torch.zeros(programs, h, dtype=torch.float32, device=x.device)
        if n:
            _backward_kernel[(programs,)](
                grad, rows2d, weight, rstd, dx, partial, n, h, stride,
                ROWS=rows_per, BLOCK=block, num_warps=warps,
            )  # fmt: skip
        return dx, partial.sum(0).to(weight.dtype), None
