"""The dense MLP, run a chunk of tokens at a time in the forwards that keep nothing for a backward.

A token's MLP output depends on that token alone, so a long sequence's MLP can run in chunks
along the sequence and give the same numbers. In a forward without gradient (get_logprobs,
top-k, reference logprobs, generation's prefill) that bounds the MLP's intermediate — [tokens,
2 * ffn / tp] for the gated projection plus [tokens, ffn / tp] after the activation — by the
chunk: at 128k tokens of a hidden-2048 model with ffn 8192 they are 6 GiB in bf16, the largest
tensors of the whole forward once the logits are chunked too. With gradient every chunk's
intermediates would be kept for the backward anyway, so training runs the MLP whole (activation
recompute is what bounds training memory). Which forwards chunk is the phase's choice
(`model/paths.ForwardPaths`: scoring and generating set `chunk_tokens`, training clears it), not a
test of the gradient mode here: a recomputed layer's gradient-free first pass runs whole, as its
recompute does.

megatron's own `mlp_chunks_for_prefill` chunks only under its inference context and by a number
of chunks, not of tokens; ours bounds the tokens, which is what memory follows.

Tensor and sequence parallelism need nothing more: each chunk goes through the same fc1/fc2
collectives (under sequence parallelism every TP rank holds the same number of tokens, so the
ranks run the same chunks in step; the gathered chunk mixes ranks' tokens, which a per-token
function does not mind).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.mlp import MLP


class ChunkedMLP(MLP):
    """megatron's `MLP`, chunked along the sequence (dim 0) while `chunk_tokens` is set."""

    chunk_tokens: int | None = None
    """Tokens per chunk, at most (this rank's; the input is [s, b, h], so a chunk is
    `chunk_tokens // b` positions of every row, at least one); None: never chunk. Set by
    `set_chunk`, for the phases that chunk."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        per_token_scale: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        s, b = hidden_states.shape[:2]
        n = None if self.chunk_tokens is None else max(1, self.chunk_tokens // b)
        if n is None or s <= n or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        out: torch.Tensor | None = None
        bias = None
        for start in range(0, s, n):
            part, bias = super().forward(hidden_states[start : start + n], **kwargs)
            if out is None:  # output rows match input rows (fc2 reduce-scatters what fc1 gathered)
                out = part.new_empty((s, *part.shape[1:]))
            out[start : start + n] = part
        assert out is not None
        return out, bias


def set_chunk(mlps: list[ChunkedMLP], tokens: int | None) -> None:
    """Chunk the dense MLPs `mlps` at `tokens` tokens from now on (None: run them whole)."""
    for module in mlps:
        module.chunk_tokens = tokens
