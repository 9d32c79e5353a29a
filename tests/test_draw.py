"""`ops.draw.race` (the one-pass draw) in Triton's interpreter, and `race_torch`: their
frequencies follow softmax(logits / T), a seed and a row's id repeat its draws however rows are
split into programs or calls, other ids draw otherwise, and -inf or NaN logits are never
drawn."""

from __future__ import annotations

import json

import pytest
from helpers import in_interpreter


@pytest.mark.processes
def test_race_draws_from_the_softmax_and_repeats_by_seed() -> None:
    lines = in_interpreter("draw_check.py")
    assert [json.loads(line)["draw"] for line in lines] == ["race", "race_torch"]
    for line in lines:
        out = json.loads(line)
        assert out["max_z"] < 4.5, out  # every likely token's share within 4.5 sigma
        assert out["hot_z"] < 4.5, out  # and the likely tokens' share together
        assert out["never_drawn_ok"] == 1, out
        assert out["same_seed_same"] and out["chunked_same"] and out["row_alone_same"], out
        assert out["other_ids_differ"] and out["other_seed_differs"], out
        assert out["dtype"] == "torch.int64"
