"""The decode attention kernel (`ops/decode_attention.py`) against SDPA, in Triton's interpreter
on the CPU (`decode_attention_check.py`, a process of its own): grouped and ungrouped heads, a
head dim that is not a power of 2, rows of different lengths, several splits of a row's keys
(one of them empty), and cache slots past each row's position that hold NaN (never read); then
a worker's `generate` with `generation.decode_attention: triton`, the kernel on every decode
step, against SDPA."""

from __future__ import annotations

import json

import pytest
from helpers import in_interpreter, make_hf_model


@pytest.mark.processes
def test_kernel_equals_sdpa_in_the_interpreter(tmp_path):
    folder = make_hf_model(tmp_path / "m", "qwen3")
    out = in_interpreter("decode_attention_check.py", folder)
    assert len(out) == 7, out
    *cases, generated = out
    splits = set()
    for line in cases:
        fields = dict(f.split("=") for f in line.split()[1:])
        bound = 1e-5 if line.startswith("float32") else 2e-3
        assert float(fields["err"]) <= bound, line
        splits.add(int(fields["splits"]))
    assert splits == {1, 3, 4}
    # the worker's decode steps through the kernel: the same tokens, logprobs to fp32 rounding
    fields = dict(f.split("=") for f in generated.split()[1:])
    assert fields["same_tokens"] == "True" and float(fields["err"]) <= 1e-5, generated


@pytest.mark.processes
def test_prefill_rows_equal_decode_steps_bitwise_in_the_interpreter():
    """`attention_rows` (a prefill computed the way a decode step computes one position) equals
    causal SDPA, and each of its rows equals a one-split decode step at that position over the
    same keys, bit for bit: what a generation whose logprobs reproduce scoring's needs."""
    result = json.loads(in_interpreter("attention_rows_check.py")[-1])
    for case, got in result.items():
        assert got["decode_elements_differing"] == 0, case
        assert got["err"] <= (1e-5 if case.startswith("float32") else 2e-3), (case, got)
