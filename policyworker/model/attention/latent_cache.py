"""Generation over a cache of latents for multi-head latent attention (DeepSeek-V3, Kimi-K2).

Latent attention makes each head's keys and values from one latent per token (`kv_lora_rank`
features, after its norm) and one RoPE key shared by the heads (`rope_dim`). The cache holds
those, [latent, rotated RoPE key] per token and layer: 576 numbers for DeepSeek-V3 where each
head's keys and values would be 128 · (192 + 128) = 40,960. A decode step attends in the
absorbed form inference engines use: each head's query without RoPE through its key
up-projection into the latent space, [q · W_uk, q_rope] against [latent, rope key] (one key head
for every query head; the values: the latents, a view of the keys' first features), and the
weighted latent through the head's value up-projection. The prefill attends over its own tokens'
per-head keys and values, as scoring does, and writes their latents.

The latent of a forward's tokens is taken from the latent's norm by a forward hook, installed
for the generating phase only (`ForwardPaths.generating`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from policyworker.model.attention.cache import KVCache
from policyworker.model.attention.cached import (
    CachedKernel,
    Generating,
    PlainWrite,
    masked_grouped,
)
from policyworker.model.attention.core import CoreAttention
from policyworker.model.attention.rotary import Rotary


class LatentCache(KVCache):
    """A `KVCache` with one key head per token, [latent, RoPE key], whose values are the latents:
    a view of the keys' first features (no second copy)."""

    def layer(
        self, number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `number`'s (keys, latents); made as zeros for keys like `key` [s, b, 1, w], the
        latents their first `value.shape[-1]` features."""
        kv = self.layers.get(number)
        if kv is None:
            keys = key.new_zeros(key.shape[1], 1, self.capacity, key.shape[3])
            kv = self.layers[number] = (keys, keys[..., : value.shape[-1]])
        return kv


@dataclass(slots=True)
class LatentLayer:
    """One latent attention layer's parts generation reads: the latent's norm (whose output is
    this forward's latent), the key/value up-projection [heads · (nope + v), kv_lora] (this TP
    rank's heads) and its widths."""

    norm: torch.nn.Module
    up: torch.nn.Module
    heads: int
    nope: int
    v: int
    latent: torch.Tensor | None = None
    """The latents [s, b, kv_lora] of the forward running now."""

    @classmethod
    def of(cls, attention: MLASelfAttention) -> LatentLayer:
        c = attention.config
        heads = attention.num_attention_heads_per_partition
        return cls(
            attention.kv_layernorm, attention.linear_kv_up_proj, heads, c.qk_head_dim, c.v_head_dim
        )

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [heads, nope, kv_lora], W_uv [heads, v, kv_lora]), views of the weight."""
        w = self.up.weight.view(self.heads, self.nope + self.v, -1)
        return w[:, : self.nope], w[:, self.nope :]

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """The norm's outputs kept as `latent` until exit."""

        def keep(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
            self.latent = out

        handle = self.norm.register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()
            self.latent = None


class LatentGenerating(Generating):
    """Generation's phase for latent attention: every layer writes its tokens' [latent, rotated
    RoPE key] and attends in the absorbed form over them (decode) or over its own tokens'
    per-head keys and values (prefill, `prefill`)."""

    def __init__(
        self,
        cache: LatentCache,
        layers: dict[int, LatentLayer],
        prefill: CachedKernel,
        rotary: Rotary,
        dtype: torch.dtype,
    ) -> None:
        # the steps and positions are the plain phase's (`begin`, `locate`); writes are its own
        super().__init__(cache, prefill, prefill, PlainWrite(), rotary, dtype)
        self.layers = layers

    def attend(
        self,
        layer: CoreAttention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams | None,
    ) -> torch.Tensor:
        step, where = self.step, self.where
        assert step is not None and where is not None, "Generating: locate() each forward"
        own = self.layers[layer.number]
        assert own.latent is not None, "LatentGenerating: the latent's norm did not run"
        s, b = query.shape[:2]
        query, key = layer.rotary(query, where.angles), layer.rotary(key, where.angles)
        latent_key = torch.cat((own.latent, key[:, :, 0, own.nope :]), dim=-1)[:, :, None]
        keys = self.cache.layer(layer.number, latent_key, own.latent)[0]
        keys[where.rows, :, where.positions] = latent_key  # [s, b, 1, kv_lora + rope]
        q = query.permute(1, 2, 0, 3)  # [b, np, s, hn]
        if step.prefill:
            k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
            out = self.prefill(q, k, v, where.positions, layer.scale)
        else:
            out = self._absorbed(own, q, step.keys_used, where.positions, layer)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _absorbed(
        self,
        own: LatentLayer,
        q: torch.Tensor,
        n: int,
        positions: torch.Tensor,
        layer: CoreAttention,
    ) -> torch.Tensor:
        """q [b, np, s, nope + rope] over the cached latents of positions < n -> [b, np, s, v]."""
        w_uk, w_uv = own.up_projections()
        q_latent = torch.einsum("bhsn,hnc->bhsc", q[..., : own.nope], w_uk)
        keys, latents = self.cache.read(layer.number, n)  # [b, 1, n, kv_lora (+ rope)]
        q_all = torch.cat((q_latent, q[..., own.nope :]), dim=-1)
        weighted = masked_grouped(q_all, keys, latents, positions, layer.scale)
        return torch.einsum("bhsc,hvc->bhsv", weighted, w_uv)
