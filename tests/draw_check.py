"""Runs `ops.draw.race` in Triton's interpreter, and `race_torch` beside it: the frequencies of
many draws against softmax(logits / T) (a vocabulary over two of a program's blocks), the same
tokens again from the same seed and row ids (split over 4 programs a row or 1, the rows in
another call), other tokens from other ids, never a token of -inf or NaN logit; one JSON line
per function. Run by `test_draw.py` with TRITON_INTERPRET=1."""

from __future__ import annotations

import json

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch

from policyworker.ops.draw import race, race_torch

ROWS, VOCAB, T = 256, 3000, 0.7


def check(draw) -> dict:  # type: ignore[no-untyped-def]
    x = torch.full((VOCAB,), -4.0)
    hot = torch.tensor([5, 2047, 2048, 2100, 2500, 2999])  # in both blocks of a program
    x[hot] = torch.tensor([1.0, 0.5, 0.0, 1.2, -0.5, 0.3])
    x[7], x[8] = float("-inf"), float("nan")
    logits = x.expand(ROWS, VOCAB).contiguous()
    ids = torch.arange(ROWS)

    def run(rows: torch.Tensor, seed: int) -> torch.Tensor:
        return draw(logits[: len(rows)], T, torch.Generator().manual_seed(seed), rows)

    tokens = run(ids, 0)  # one row's draw per id: the rows are independent draws
    few = ids[:16]  # 4 programs a row: the chunks' winners merged
    first, again = run(few, 0), run(few, 0)
    moved = run(ids[8:12], 0)  # rows 8..11 alone: the same draws as in the whole call
    other_ids, other_seed = run(few + 1000, 0), run(few, 1)
    clean = torch.where(torch.isnan(x), float("-inf"), x)
    p = torch.softmax(clean.double() / T, 0)
    seen = torch.bincount(tokens, minlength=VOCAB).double() / ROWS
    sigma = (p * (1 - p) / ROWS).sqrt()
    z = ((seen - p).abs() / sigma.clamp_min(1e-12))[p > 1e-3]
    hot_sigma = (p[hot].sum() * (1 - p[hot].sum()) / ROWS).sqrt()
    return {
        "draw": draw.__name__,
        "max_z": float(z.max()),
        "hot_z": float((seen[hot].sum() - p[hot].sum()).abs() / hot_sigma),
        "never_drawn_ok": int(seen[7] == 0 and seen[8] == 0),
        "same_seed_same": bool(torch.equal(first, again)),
        "chunked_same": bool(torch.equal(first, tokens[:16])),
        "row_alone_same": bool(torch.equal(moved, tokens[8:12])),
        "other_ids_differ": bool(not torch.equal(first, other_ids)),
        "other_seed_differs": bool(not torch.equal(first, other_seed)),
        "dtype": str(tokens.dtype),
    }


def main() -> None:
    for draw in (race, race_torch):
        print(json.dumps(check(draw)))


if __name__ == "__main__":
    main()
