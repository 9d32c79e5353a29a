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
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from policyworker.model.attention.layout import CachedKernel, Kernels, locate
from policyworker.model.attention.masked import Causal, Masked
from policyworker.model.attention.rotary import Rotary


class Softmax(Protocol):
    """A layer's softmax (`attention/masked.py`): the kernels it runs in a phase."""

    def kernels(self, phase: Kernels) -> Kernels: ...

    def cached(self, phase: CachedKernel) -> CachedKernel: ...


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
        kernels = layer.softmax.kernels(self.kernels)
        return where.attend(kernels, query, key, value, layer.scale)


class _Unbuilt:
    def attend(self, *args: object) -> torch.Tensor:
        raise RuntimeError("attention: the model was built without ForwardPaths.install")


class Switch[P]:
    """The phase every layer of a kind runs now (shared by those layers of one model): attention
    phases (`Phase`), a Gated DeltaNet layer's recurrence (`linear_attention.Mixing`)."""

    def __init__(self, phase: P) -> None:
        self.now = phase

    @contextlib.contextmanager
    def using(self, phase: P) -> Iterator[None]:
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
        window: int = 0,
    ) -> None:
        """`k_channels`, `v_channels`: a head's key and value widths where they differ (MLA):
        the kernels read them from the tensors. `window`: this layer's sliding window (0:
        none); `config.softmax_type == "learnable"`: a sink logit per head (`softmax_offset`,
        megatron's name, split over TP with the heads)."""
        super().__init__(config=config)
        self.number = layer_number
        """megatron's layer number (global, from 1): this layer's slot in a KV cache."""
        self.scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.rotary = Rotary()
        self.switch: Switch[Phase] = Switch(_Unbuilt())
        self.softmax_offset: torch.nn.Parameter | None = None
        if config.softmax_type == "learnable":
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"CoreAttention: softmax_type {config.softmax_type!r}")
        plain = not window and self.softmax_offset is None
        self.softmax: Softmax = Causal() if plain else Masked(window, self.softmax_offset)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict | None = None,
    ) -> dict:
        """The sinks split over TP along the heads (megatron's default would call them
        replicated)."""
        state = {} if self.softmax_offset is None else {"softmax_offset": self.softmax_offset}
        return sharded_params(state, prefix, {"softmax_offset": 0}, sharded_offsets, metadata)

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


def sharded_params(
    params: dict[str, torch.Tensor],
    prefix: str,
    tp_axes: dict[str, int],
    sharded_offsets: tuple[tuple[int, int, int], ...],
    metadata: dict | None,
) -> dict:
    """A module's own parameters as checkpoint tensors: those in `tp_axes` split over TP along
    that axis, the rest whole on every TP rank."""
    return make_sharded_tensors_for_checkpoint(
        params,
        prefix,
        tp_axes,
        sharded_offsets,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"],
    )
