"""The core attention megatron's `SelfAttention` calls, without Transformer Engine.

It takes megatron's queries, keys and values (after the QKV projection and q/k norms) and hands
them to the phase its model runs now (`Switch.now`): RoPE, then causal attention by the phase's
kernels, or a KV cache's write and attention in generation. A phase is an object chosen once
when the model is built (`model/paths.py`) and installed by the service that runs the forward
(training, scoring, generating); nothing here asks what device, dtype or mode it runs in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.model.attention.layout import Kernels, locate
from policyworker.model.attention.rotary import Rotary


class Phase(Protocol):
    """What every attention layer of a model runs in one phase."""

    def attend(
        self,
        layer: CoreAttention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams | None,
    ) -> torch.Tensor:
        """megatron's q [s, b, np, hn] / k, v [s, b, ng, hn] (or THD [t, h, hn]) -> the
        attention output, heads flattened."""
        ...


@dataclass(frozen=True, slots=True)
class Fresh:
    """Attention over the forward's own tokens (training, scoring): RoPE at the layout's
    positions, then `kernels`. `in_place`: long inputs are rotated in place (scoring)."""

    kernels: Kernels
    in_place: bool

    def attend(
        self,
        layer: CoreAttention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams | None,
    ) -> torch.Tensor:
        where = locate(query, params)
        angles = layer.rotary.angles(where.positions, query.dtype)  # made once for q and k
        query = layer.rotary(query, angles, self.in_place)
        key = layer.rotary(key, angles, self.in_place)
        return where.attend(self.kernels, query, key, value, layer.scale)


class _Unbuilt:
    def attend(self, *args: object) -> torch.Tensor:
        raise RuntimeError("attention: the model was built without ForwardPaths.install")


class Switch:
    """The phase every attention layer of one model runs now (shared by its layers)."""

    def __init__(self, phase: Phase) -> None:
        self.now = phase

    @contextlib.contextmanager
    def using(self, phase: Phase) -> Iterator[None]:
        before, self.now = self.now, phase
        try:
            yield
        finally:
            self.now = before


class CoreAttention(MegatronModule):
    """Drop-in for megatron's `DotProductAttention` (its constructor and forward signature).
    Attention dropout is always 0 here (`model.build.transformer_config`)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: object,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        """`k_channels`, `v_channels`: a head's key and value widths where they differ (MLA):
        the kernels read them from the tensors."""
        super().__init__(config=config)
        self.number = layer_number
        """megatron's layer number (global, from 1): this layer's slot in a KV cache."""
        self.scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.rotary = Rotary()
        self.switch = Switch(_Unbuilt())

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("CoreAttention: attention_bias is not supported")
        return self.switch.now.attend(self, query, key, value, packed_seq_params)
