"""Rotary position embedding, `x * cos + rotate_half(x) * sin`, as one Triton kernel on the GPU.

x is [..., heads, head_dim] with one or two leading dimensions (packed [t, h, d], padded or
decoding [s, b, h, d]); cos and sin broadcast over the heads ([t, 1, d], [s, 1, 1, d] or
[s, b, 1, d]) and are read in place through their strides, as is x (views of megatron's fused
QKV output included). The rotation is computed in fp32 and rounded once; its backward is the
inverse rotation of the gradient, by the same kernel. On the CPU (and in fp64) it is the torch
ops, exact. A launch costs ~25 µs of host time where the torch.compile'd function cost ~100 µs
in a training forward on an H100's host; a layer calls it twice.

`rope_into_cache` is a KV cache's write in one kernel (the queries and keys rotated, the keys and
values stored at their rows' positions): a decode step's four small kernels a layer in one.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (module docstring)."""
    if x.is_cuda and x.dtype != torch.float64 and x.dim() in (3, 4):
        return _Rope.apply(x, cos, sin)
    return reference(x, cos, sin)


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch ops (HF's `apply_rotary_pos_emb`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@triton.jit
def _rotate_into(x, y, mask, cos, sin, cos_mask, HALF: tl.constexpr, INVERSE: tl.constexpr):
    """Heads at x (pointers to their first halves, `mask` their shape) rotated in fp32 by the
    angles at `cos`/`sin` (`cos_mask` their shape; x's rows may broadcast them), rounded once
    into y (x itself is fine: each element is read before it is written, by the same program).
    One function for both kernels, so that a key rotated into the cache has the bits of the
    same key rotated for scoring."""
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos, mask=cos_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF, mask=cos_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin, mask=cos_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF, mask=cos_mask, other=0.0).to(tl.float32)
    if INVERSE:  # the transpose: the gradient of the rotation below
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    tl.store(y, y1.to(y.dtype.element_ty), mask=mask)
    tl.store(y + HALF, y2.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr, n, inner,
    xa, xb, xh, ca, cb, heads,
    HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """Rows n = a * inner + b (the leading dimensions) of one head; y is contiguous."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    head = tl.program_id(1)
    col = tl.arange(0, BLOCK)
    mask = (rows < n)[:, None] & (col < HALF)[None, :]
    a, b = (rows // inner).to(tl.int64)[:, None], (rows % inner).to(tl.int64)[:, None]
    x = x_ptr + a * xa + b * xb + head * xh + col[None, :]
    angle = a * ca + b * cb + col[None, :]
    y = y_ptr + (rows.to(tl.int64)[:, None] * heads + head) * (2 * HALF) + col[None, :]
    _rotate_into(x, y, mask, cos_ptr + angle, sin_ptr + angle, mask, HALF, INVERSE)


def _leading(t: torch.Tensor, shape: torch.Size) -> tuple[int, int]:
    """t's strides over the one or two leading dimensions of `shape` (0 where broadcast)."""
    strides = t.expand(*shape[:-2], *t.shape[-2:]).stride()[:-2]
    return (strides[0], 0) if len(strides) == 1 else (strides[0], strides[1])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    d = x.shape[-1]
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or d % 2:
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    lead, heads = x.shape[:-2], x.shape[-2]
    n, inner = lead.numel(), (lead[1] if len(lead) == 2 else 1)
    xa, xb = (x.stride(0), 0) if len(lead) == 1 else (x.stride(0), x.stride(1))
    ca, cb = _leading(cos, x.shape)
    block = triton.next_power_of_2(d // 2)
    rows = max(1, min(64, 2048 // block))
    if n and heads:
        _rope_kernel[(triton.cdiv(n, rows), heads)](
            x, cos, sin, y, n, inner, xa, xb, x.stride(-2), ca, cb, heads,
            HALF=d // 2, ROWS=rows, BLOCK=block, INVERSE=inverse,
        )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True).to(ctx.dtype), None, None


@triton.jit
def _into_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, batch,
    qs, qb, qh, ks, kb, kh, vs, vb, vh, cs, cb, kcb, kch, kcn, vcb, vch, vcn,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One token t = i * batch + row: its query heads rotated in place, its key heads rotated
    and its value heads copied into the cache's row at the token's position."""
    t = tl.program_id(0)
    i, row = (t // batch).to(tl.int64), (t % batch).to(tl.int64)
    at = tl.load(pos_ptr + t).to(tl.int64)
    col = tl.arange(0, BLOCK)
    half = (col < HALF)[None, :]
    angle = cos_ptr + i * cs + row * cb + col[None, :]  # [1, BLOCK]: every head's
    sine = sin_ptr + i * cs + row * cb + col[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]
    x = q_ptr + i * qs + row * qb + heads * qh + col[None, :]
    _rotate_into(x, x, (heads < HEADS) & half, angle, sine, half, HALF, False)
    groups = tl.arange(0, BLOCK_G)[:, None]
    mask = (groups < GROUPS) & half
    x = k_ptr + i * ks + row * kb + groups * kh + col[None, :]
    y = kc_ptr + row * kcb + groups * kch + at * kcn + col[None, :]
    _rotate_into(x, y, mask, angle, sine, half, HALF, False)
    x = v_ptr + i * vs + row * vb + groups * vh + col[None, :]
    y = vc_ptr + row * vcb + groups * vch + at * vcn + col[None, :]
    tl.store(y, tl.load(x, mask=mask, other=0.0), mask=mask)
    tl.store(y + HALF, tl.load(x + HALF, mask=mask, other=0.0), mask=mask)


def rope_into_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    angles: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """A KV cache's write in one kernel: the queries [s, b, np, d] rotated in place (no
    temporary of their size, as `Rotary` does for a long prefill), the keys [s, b, ng, d]
    rotated and the values copied into the cache's keys and values [b, ng, capacity, d] at
    `positions` [s, b] — what `rope` of the queries and the keys and two indexed writes do in
    four (bitwise: the rotation is `rope`'s). The angles (cos, sin) are [s, b, 1, d] in the
    queries' dtype; the tensors' last dims contiguous, d even."""
    cos, sin = angles
    s, b, heads, d = query.shape
    groups = key.shape[2]
    keys, values = cache
    assert d % 2 == 0 and cos.stride() == sin.stride() and positions.is_contiguous()
    assert cos.dtype == query.dtype and all(
        t.stride(-1) == 1 for t in (query, key, value, cos, keys, values)
    )
    if s * b:
        _into_cache_kernel[(s * b,)](
            query, key, value, cos, sin, positions, keys, values, b,
            *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *cos.stride()[:2],
            *keys.stride()[:3], *values.stride()[:3],
            HEADS=heads, GROUPS=groups, HALF=d // 2, BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_G=triton.next_power_of_2(groups), BLOCK=triton.next_power_of_2(d // 2),
        )  # fmt: skip
