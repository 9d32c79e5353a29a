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
Without a query latent (`q_lora_rank: null`: Moonlight, DeepSeek-V2-Lite) its spec resolver asks
for Transformer Engine's fused norm+linear as the query projection, though that query has no norm
(`QKNormConfigResolver._mla_fused_linear_or_default`): the spec's own `linear_q_proj` is taken
(`plain_query_projection`). Installed before a model with latent attention is built; idempotent.
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


def plain_query_projection(original: Any) -> Any:
    """The resolver's choice for a fused projection, but a spec's `linear_q_proj` as given."""

    def resolve(self: Any, module_spec: Any, module_name: str) -> Any:
        if module_name == "linear_q_proj" and module_spec is not None:
            return module_spec
        return original(self, module_spec, module_name)

    return resolve


def install(duplicated: type) -> None:
    """`duplicated`: the down-projection class (`model.latent.DuplicatedLinear`)."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer import mla_qk_norm_config, multi_latent_attention

    require_mcore("mla", "MLASelfAttention's RoPE and QKNormConfigResolver")
    resolver = mla_qk_norm_config.QKNormConfigResolver
    resolver._mla_fused_linear_or_default = plain_query_projection(
        resolver._mla_fused_linear_or_default
    )
    multi_latent_attention.apply_rotary_pos_emb = halves_only
    multi_latent_attention.RotaryEmbedding = NoFrequencies
    if multi_latent_attention.TELinear is None:  # no Transformer Engine
        multi_latent_attention.TELinear = duplicated
    _installed = True
