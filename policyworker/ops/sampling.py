"""Drawing the next token from full-vocabulary logits [B, V], and the logprob reported for it.

The draw: logits / temperature, restricted to the `top_k` most likely tokens and to the
smallest set whose probability reaches `top_p` (renormalized), then one multinomial draw per
row from a seeded generator (`greedy`: the most likely token, no draw). Without top-k/top-p,
where Triton runs, the draw is `ops.draw.race`: the same distribution in one pass.

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
from policyworker.ops.draw import race
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
    logits: torch.Tensor, how: Sampling, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] int64, its logprob [B] fp32) from one step's logits [B, V]."""
    if not how.greedy and _unrestricted(how, logits.shape[-1]) and triton_runs(logits):
        tokens = race(logits, how.temperature, generator)  # one pass over the logits
    elif how.greedy:  # a positive temperature and fp32 do not move the arg max: no copy
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits.float()
        if how.temperature != 1.0:  # x / 1.0 is x: a pass over [B, V] saved per step
            scaled = scaled / how.temperature
        probs = torch.softmax(restrict(scaled, how.top_k, how.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
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
