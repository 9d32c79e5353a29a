"""Runs `ops.token_gather`'s Triton kernel in Triton's interpreter (on the CPU, numpy) against the
torch sum the CPU uses, one JSON line. Run by `test_token_gather.py` with TRITON_INTERPRET=1
(Triton reads it when the kernel is defined, so it needs a process of its own)."""

from __future__ import annotations

import json

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch

from policyworker.ops import token_gather


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, float] = {}
    # a row longer than one block (its tail masked), rows gathered more than once
    src = torch.randn(40, token_gather.BLOCK + 300)
    slots = torch.randint(0, 40, (13, 3))
    ours, torchs = token_gather._kernel_sum(src, slots), token_gather._torch_sum(src, slots)
    out["fp32_max_diff"] = float((ours - torchs).abs().max())
    bf16 = src.bfloat16()
    ours, torchs = token_gather._kernel_sum(bf16, slots), token_gather._torch_sum(bf16, slots)
    ulp = torchs.float().abs().clamp_min(1e-30).log2().floor().exp2() * 2.0**-7
    out["bf16_ulps"] = float(((ours.float() - torchs.float()).abs() / ulp).max())
    out["shape_ok"] = float(ours.shape == (13, token_gather.BLOCK + 300))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
