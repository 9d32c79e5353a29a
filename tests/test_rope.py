"""`ops.rope`: the Triton kernel (GPU) against the torch ops in Triton's interpreter, forward and
backward, on packed, padded, decoding and fused-QKV-view layouts; and `rope_into_cache` (a KV
cache's write in one kernel) bitwise against the kernel and two indexed writes."""

from __future__ import annotations

import json

import pytest
from helpers import in_interpreter


@pytest.mark.processes
def test_kernel_equals_the_torch_ops_in_the_interpreter():
    result = json.loads(in_interpreter("rope_check.py")[-1])
    for case in [c for c in result if c.startswith("into_cache")]:
        # a KV cache's write: rope's kernel's bits, every other slot untouched
        assert result.pop(case) == {"query": 1.0, "keys": 1.0, "values": 1.0}, case
    for case, errors in result.items():
        assert errors.pop("same_kind") == 1.0, case
        # fp32: the same products and sums; bf16: one rounding (the interpreter truncates)
        bound = 1e-6 if case.startswith("fp32") else 2e-2
        assert max(errors.values()) <= bound, (case, errors)
