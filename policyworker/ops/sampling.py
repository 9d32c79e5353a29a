"""Drawing the next token from full-vocabulary logits [B, V], and the logprob reported for it.

The draw: logits / temperature, restricted to the `top_k` most likely tokens and to the
smallest set whose probability reaches `top_p` (renormalized), then one draw per row
(`greedy`: the most likely token, no draw) as an exponential race (`ops.draw`): its noise is
keyed by a step seed from the call's generator and the row's id, so a row's draw does not
depend on the other rows of the call or on which data-parallel rank draws it. Where Triton
runs it is one pass over the logits (`race`), elsewhere torch operations (`race_torch`).

The reported logprob is the token's log-softmax of logits / temperature over the whole
vocabulary — what `get_logprobs` and every loss compute, with the same function
(`ops.logprobs.logprobs_at`, so the same roundings) — not of the filtered distribution it was
drawn from: the generation logprobs of a response equal its `get_logprobs`, and with top-k/top-p
they are lower than the drawing distribution's by the log of the mass kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from policyworker.ops.compiled import triton_runs
from policyworker.ops.draw import race, race_torch
from policyworker.ops.logprobs import Head, LogitOptions, logprobs_at


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How one generation call draws tokens."""

    temperature: float
    top_k: int | None = None
    top_p: float = 1.0
    greedy: bool = False


def restrict(scaled: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """`scaled` [B, V] with -inf outside each row's top-k and top-p sets (ties at the k-th value
    are kept; the top-p set always holds the most likely token)."""
    out = scaled
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # the mass of the more likely tokens
        drop = before >= top_p
        out = out.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return out


def _unrestricted(how: Sampling, vocab: int) -> bool:
    return (how.top_k is None or how.top_k >= vocab) and how.top_p >= 1.0


def next_tokens(
    logits: torch.Tensor,
    how: Sampling,
    generator: torch.Generator | None,
    row_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] int64, its logprob [B] fp32) from one step's logits [B, V]; `row_ids` [B]
    (on the logits' device) key each row's noise."""
    if how.greedy:  # a positive temperature and fp32 do not move the arg max: no copy
        tokens = logits.argmax(dim=-1)
    else:
        x, temperature = logits, how.temperature  # unrestricted: one pass over the logits
        if not _unrestricted(how, logits.shape[-1]):
            x = restrict(logits.float() / temperature, how.top_k, how.top_p)
            temperature = 1.0
        draw = race if triton_runs(x) else race_torch
        tokens = draw(x, temperature, generator, row_ids)
    opts = LogitOptions(temperature=how.temperature, tp_group=None)
    logp, _ = logprobs_at(Head.of_logits(logits[:, None]), tokens[:, None, None], opts)
    return tokens, logp[:, 0, 0]


def pad_token(hf_config: Any, tokenizer: Any | None) -> int:
    """The id generated rows are padded with: the tokenizer's pad token, else the model
    config's, else 0."""
    pad = None if tokenizer is None else tokenizer.pad_token_id
    if pad is None:
        pad = getattr(hf_config, "pad_token_id", None)
    return 0 if pad is None else int(pad)
