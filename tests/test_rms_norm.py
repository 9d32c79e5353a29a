"""`ops.rms_norm`: the Triton kernels (GPU) against the torch ops in Triton's interpreter, and
the rows they read from views of a fused QKV output without a copy."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import in_interpreter
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from policyworker.ops.rms_norm import _rows, reference, rms_norm


def test_cpu_is_transformers_arithmetic():
    hf = LlamaRMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(hf.weight)
    x = torch.randn(3, 5, 64).bfloat16()
    hf = hf.bfloat16()
    assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))
    assert torch.equal(
        rms_norm(x.float(), hf.weight.float(), 1e-5), reference(x.float(), hf.weight.float(), 1e-5)
    )


def test_rows_of_a_fused_qkv_view_are_read_in_place():
    qkv = torch.randn(5, 2, 4, 6 * 16)  # [s, b, groups, (q heads + k + v) * head_dim]
    key = qkv[..., 4 * 16 : 5 * 16]
    rows, stride = _rows(key)
    assert rows.data_ptr() == key.data_ptr() and stride == 6 * 16
    assert torch.equal(rows, key.reshape(-1, 16))
    transposed = torch.randn(24, 7).t()
    rows, stride = _rows(transposed)
    assert stride == 24 and torch.equal(rows, transposed.contiguous())


@pytest.mark.processes
def test_kernels_equal_the_torch_ops_in_the_interpreter():
    result = json.loads(in_interpreter("rms_norm_check.py")[-1])
    for case, errors in result.items():
        assert errors.pop("dtype_ok"), case
        # fp32: summation order only; bf16: a rounding or two (the interpreter truncates)
        bound = 1e-6 if case.startswith("fp32") else 2e-2
        assert max(errors.values()) <= bound, (case, errors)
