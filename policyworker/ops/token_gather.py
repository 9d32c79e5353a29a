"""Moving an MoE layer's tokens to their experts and back with gathers only, no atomic adds.

With top-k routing each token is copied to k expert rows (`dispatch`) and the k expert outputs
are summed back into it (`combine`). megatron's dispatcher does the copy with `index_select`,
whose backward is an atomic `index_add_`, and the sum with an atomic `scatter_add_`: bf16
atomics, 6.8 + 3.1 ms of the 129 ms of kernels in `benchmarks/moe_bench.py`'s train step on an
H100; here the row copies take 2.1 ms and the sums less (BENCHMARKS.md). Atomics also make the
result depend on thread timing. Both
directions here are gathers: a token's k rows are known in advance (`slots`, [T, k]), so the sum
reads them and adds in fp32, in slot order, and rounds once — deterministic, and at least as
exact as megatron's bf16 atomics (which round after every add).

`dispatch` and `combine` are each other's adjoint: the backward of one is the forward of the
other. On the GPU the sum is one Triton kernel; elsewhere the same sum in torch, in the same
order (fp32: bitwise the kernel's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _sum_slots_kernel(src_ptr, slots_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(slots_ptr + token * K + j).to(tl.int64)
        acc += tl.load(src_ptr + row * H + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slots(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j src[slots[t, j]] for src [N, H], slots [T, K] (int): accumulated in fp32 in
    the order j = 0..K-1 (fp64 in fp64), rounded once to src's dtype."""
    kernel = src.is_cuda and src.dtype != torch.float64
    return _kernel_sum(src, slots) if kernel else _torch_sum(src, slots)


def _kernel_sum(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    src, slots = src.contiguous(), slots.contiguous()
    (tokens, k), hidden = slots.shape, src.shape[1]
    out = torch.empty(tokens, hidden, dtype=src.dtype, device=src.device)
    if tokens and hidden:
        grid = (tokens, triton.cdiv(hidden, BLOCK))
        _sum_slots_kernel[grid](src, slots, out, hidden, K=k, BLOCK=BLOCK)
    return out


def _torch_sum(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(src.dtype, torch.float32)
    acc = src.new_zeros(slots.shape[0], src.shape[1], dtype=dtype)
    for j in range(slots.shape[1]):
        acc += src.index_select(0, slots[:, j])
    return acc.to(src.dtype)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, slots)
        return tokens.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rows, slots = ctx.saved_tensors
        return _Combine.apply(grad, rows, slots), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, expert_rows: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, slots)
        return sum_slots(expert_rows, slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rows, slots = ctx.saved_tensors
        return _Dispatch.apply(grad, rows, slots), None, None


def dispatch(tokens: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """tokens [T, H] -> expert rows [T*k, H]: row i is tokens[rows[i]]. `slots` [T, k] is the
    inverse (rows[slots[t, j]] = t), used by the backward."""
    return _Dispatch.apply(tokens, rows, slots)


def combine(expert_rows: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """expert rows [T*k, H] -> tokens [T, H]: token t is Σ_j expert_rows[slots[t, j]]."""
    return _Combine.apply(expert_rows, rows, slots)


def token_slots(rows: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """[tokens, k]: where each token's k copies are among `rows` (each token exactly k times),
    in increasing row order."""
    return torch.argsort(rows, stable=True).view(tokens, k)
