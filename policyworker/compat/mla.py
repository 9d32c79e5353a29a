"""megatron-core 0.19's multi-head latent attention without its own RoPE.

`MLASelfAttention` rotates the RoPE features of its queries and keys itself, at positions it
counts itself: 0..s-1 of each forward (wrong for a decode step over a KV cache), and for packed
sequences under context parallelism by its own split of the sequences (not ours: it fails on our
layout). Our core attention rotates every model's queries and keys at the layout's positions, MLA's
included (`rotary.Partial` over the last `rope_dim` features). `install()` reduces MLA's RoPE to
what it does besides rotating: its interleaved RoPE features (DeepSeek's checkpoints' order:
pairs) are taken apart into halves, evens then odds, as megatron does before rotating; no
frequencies are made (`NoFrequencies`: megatron's would also read its CP split on the CUDA
device). And it is given our whole-on-every-rank down-projection where it asks for Transformer
Engine's (`TELinear` with `parallel_mode="duplicated"`): its local alternative,
ColumnParallelLinear, leaves the RoPE key's gradient short under TP (`model/latent.py`).
Installed before a model with latent attention is built; idempotent.
"""

from __future__ import annotations

from typing import Any

import torch

from policyworker.compat.version import require_mcore

_installed = False


def halves_only(
    t: torch.Tensor, freqs: Any = None, *args: Any, mla_rotary_interleaved: bool = False, **kw: Any
) -> torch.Tensor:
    """megatron's `apply_rotary_pos_emb` as MLA calls it, less the rotation."""
    if not mla_rotary_interleaved:
        return t
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


class NoFrequencies(torch.nn.Module):
    """In place of MLA's RotaryEmbedding (same constructor arguments): no angles."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(0)


def install(duplicated: type) -> None:
    """`duplicated`: the down-projection class (`model.latent.DuplicatedLinear`)."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer import multi_latent_attention

    require_mcore("mla", "MLASelfAttention's RoPE")
    multi_latent_attention.apply_rotary_pos_emb = halves_only
    multi_latent_attention.RotaryEmbedding = NoFrequencies
    if multi_latent_attention.TELinear is None:  # no Transformer Engine
        multi_latent_attention.TELinear = duplicated
    _installed = True
