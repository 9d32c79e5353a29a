"""`ops.draw.race` (the one-pass draw) in Triton's interpreter: its frequencies follow
softmax(logits / T), a seed repeats its draws however rows are split into programs, and -inf or
NaN logits are never drawn."""

from __future__ import annotations

import json

import pytest
from helpers import in_interpreter


@pytest.mark.processes
def test_race_draws_from_the_softmax_and_repeats_by_seed() -> None:
    (line,) = in_interpreter("draw_check.py")
    out = json.loads(line)
    assert out["max_z"] < 4.5, out  # every likely token's share within 4.5 sigma
    assert out["hot_z"] < 4.5, out  # and the likely tokens' share together
    assert out["never_drawn_ok"] == 1
    assert out["same_seed_same"] and out["chunked_same"] and out["other_seed_differs"]
    assert out["dtype"] == "torch.int64"
