"""Runs `ops.rope`'s Triton kernel in Triton's interpreter (on the CPU, numpy) against the torch
ops (`reference`), forward and backward, on the layouts attention gives it; one JSON line. Run by
`test_rope.py` with TRITON_INTERPRET=1 (read when the kernel is defined: a process of its own)."""

from __future__ import annotations

import json

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch

from policyworker.ops import rope


def _angles(shape: tuple[int, ...], d: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.rand(*shape, d // 2) * 10
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _compare(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, float]:
    grad = torch.randn(x.shape, dtype=x.dtype)
    results = []
    for fn in (rope._Rope.apply, rope.reference):
        xs = x.detach().requires_grad_()
        y = fn(xs, cos, sin)
        y.backward(grad)
        results.append((y.detach().float(), xs.grad.float(), y.dtype, y.shape))
    (y, dx, dt, shape), (ry, rdx, rdt, rshape) = results
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return {"y": rel(y, ry), "dx": rel(dx, rdx), "same_kind": float(dt == rdt and shape == rshape)}


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, object] = {}
    c, s = _angles((37, 1), 16)  # packed: [t, h, d], angles [t, 1, d]
    out["fp32_packed"] = _compare(torch.randn(37, 3, 16), c, s)
    c, s = _angles((9, 1, 1), 16)  # padded: [s, b, h, d], angles [s, 1, 1, d]
    out["fp32_padded"] = _compare(torch.randn(9, 2, 3, 16), c, s)
    c, s = _angles((5, 4, 1), 16)  # decoding: one angle per row, [s, b, 1, d]
    out["fp32_decode"] = _compare(torch.randn(5, 4, 3, 16), c, s)
    c, s = _angles((6, 1, 1), 16)  # the key heads of a fused QKV output: a strided view
    qkv = torch.randn(6, 2, 2, 5 * 16)
    out["fp32_view"] = _compare(qkv[..., 3 * 16 : 4 * 16].unflatten(-1, (1, 16)).squeeze(-2), c, s)
    c, s = _angles((33, 1), 64)
    out["bf16"] = _compare(torch.randn(33, 4, 64).bfloat16(), c.bfloat16(), s.bfloat16())
    for dtype in (torch.float32, torch.float16):
        out[f"into_cache_{str(dtype)[6:]}"] = _into_cache(dtype)
    print(json.dumps(out))


def _into_cache(dtype: torch.dtype) -> dict[str, float]:
    """`rope_into_cache` against `rope`'s kernel and two indexed writes, on views of a fused
    QKV output ([s, b, groups, (rep + 2) * d]; the queries rotated in place), rows at their own
    positions: 1.0 where bitwise equal; and whether cache slots that were not written are
    untouched."""
    s, b, groups, rep, d, capacity = 3, 4, 2, 3, 16, 40
    qkv = torch.randn(s, b, groups, (rep + 2) * d, dtype=dtype)
    query = qkv[..., : rep * d].reshape(s, b, groups * rep, d)
    key, value = qkv[..., rep * d : (rep + 1) * d], qkv[..., (rep + 1) * d :]
    positions = torch.tensor([5, 0, 17, 30])[None, :] + torch.arange(s)[:, None]  # [s, b]
    cos, sin = (a.to(dtype) for a in _angles((s, b, 1), d))
    keys, values = (torch.full((b, groups, capacity, d), 7.0, dtype=dtype) for _ in range(2))
    want_k, want_v, want_q = keys.clone(), values.clone(), rope._rotate(query, cos, sin, False)
    rope.rope_into_cache(query, key, value, (cos, sin), positions, (keys, values))
    rows = torch.arange(b)[None, :].expand(s, b)
    want_k[rows, :, positions] = rope._rotate(key, cos, sin, inverse=False)
    want_v[rows, :, positions] = value
    return {
        "query": float(torch.equal(query, want_q)),
        "keys": float(torch.equal(keys, want_k)),
        "values": float(torch.equal(values, want_v)),
    }


if __name__ == "__main__":
    main()
