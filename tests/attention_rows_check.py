"""Runs `ops.decode_attention`'s prefill kernel (`attention_rows`) in Triton's interpreter:
against SDPA's causal attention, and row by row against a decode step (`decode_attention(
one_split=True)`) over the same keys, which it must equal bitwise, at every 5th position and
on each side of the key blocks' edges; one JSON line. Run by `test_decode_attention.py` with
TRITON_INTERPRET=1. fp32 and fp16 (the interpreter computes bf16 dot products wrongly; bf16 is
the GPU test's)."""

from __future__ import annotations

import json

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch
import torch.nn.functional as F

from policyworker.ops.decode_attention import attention_rows, decode_attention

CASES = [  # dtype, rows, query heads, key heads, head dim, sequence
    (torch.float32, 2, 8, 2, 32, 45),  # several query tiles, a sequence not a tile multiple
    (torch.float32, 1, 3, 3, 24, 140),  # no grouping, a head dim not a power of 2, 2 key blocks
    (torch.float16, 2, 4, 1, 16, 150),  # fp16: the key block of 256
]


def main() -> None:
    torch.manual_seed(0)
    out = {}
    for dtype, b, heads, groups, dim, seq in CASES:
        q = torch.randn(b, heads, seq, dim, dtype=dtype)
        k, v = (torch.randn(b, groups, seq, dim, dtype=dtype) for _ in range(2))
        scale = dim**-0.5
        rows = attention_rows(q, k, v, scale)
        ref = F.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=True, scale=scale, enable_gqa=True
        )
        differing = 0
        # every 5th position, and each side of the key blocks' edges (64 fp32, 128 fp16 keys)
        edges = {63, 64, 65, 127, 128, 129, seq - 1}
        for t in sorted(set(range(0, seq, 5)) | {t for t in edges if t < seq}):
            at = torch.full((b,), t)
            step = decode_attention(q[:, :, t].contiguous(), k, v, at, scale, one_split=True)
            differing += int((step != rows[:, :, t]).sum())
        name = f"{str(dtype).split('.')[-1]}_{heads}x{groups}_{dim}_{seq}"
        out[name] = {
            "err": float((rows.double() - ref).abs().max()),
            "decode_elements_differing": differing,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
