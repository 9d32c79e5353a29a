"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next, in megatron's
self-attention slot of a decoder layer (the hybrid pattern is a layer spec per layer:
`model/build.layer_spec`).

    x ─ in_proj ─ qkv ─ causal depthwise conv (kernel K) + silu ─ q, k, v (q/k: key heads)
                ─ z (the output gate), b, a ─ β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, β)   (`ops/gated_delta.py`; q/k repeated to the value heads)
    out = linear_proj(RMSNorm(o) · silu(z))  (the norm per value head, HF's gated arithmetic)

The arithmetic is transformers' `Qwen3_5GatedDeltaNet` (the conv in the weight's dtype, the
decay and the recurrence in fp32). How the recurrence runs is the phase's, a small type on a
switch every such layer shares (`ForwardPaths.install`): `Whole` in training and scoring (packed
sequences (THD) each from a zero state and an empty conv window: nothing crosses a `cu_seqlens`
boundary; the rule itself ours in PyTorch or flash-linear-attention's kernels), `Cached` in
generation (a `StateCache` of each row's conv window and state).

Tensor parallelism splits the heads: the in-projection is one column-parallel GEMM whose rows are
the blocks q, k, v, z, b, a, each split over TP on its own (`layouts.Parts`), so a rank holds
its key heads, the value heads that read them, and their conv channels, decays and gates; the
out-projection is row-parallel. The norm's weight (one per value channel, every head's) is whole
on each rank and its gradient summed over TP. Under context parallelism each layer all-gathers
its inputs' sequences, runs them whole and keeps this rank's tokens (`Whole.mix`: exact; the
recurrence's work repeated on each CP rank, where heads split over CP would not repeat it).
"""

from __future__ import annotations

import itertools
from itertools import pairwise
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.model.attention.core import Switch, sharded_params
from policyworker.model.hf_config import DeltaNetShape
from policyworker.ops import gated_delta
from policyworker.ops.rms_norm import rms_norm
from policyworker.parallel.context import ContextSplit, HostPacked


class GatedDeltaNet(MegatronModule):
    """The layer (module docstring); built by megatron's `TransformerLayer` like its
    self-attention, with this layer's `shape`."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: object = None,
        layer_number: int = 1,
        *,
        shape: DeltaNetShape,
        **megatron: Any,
    ) -> None:
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.shape, self.eps = shape.split(tp), config.layernorm_epsilon
        """This rank's heads (`DeltaNetShape.split`)."""
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, sum(shape.in_blocks), config=config,
            init_method=config.init_method, gather_output=False, bias=False,
        )  # fmt: skip
        dtype, local = config.params_dtype, self.shape
        self.conv_weight = _split(
            torch.empty(sum(local.conv_blocks), 1, local.conv_kernel, dtype=dtype)
        )
        self.A_log = _split(torch.empty(local.value_heads, dtype=dtype))
        self.dt_bias = _split(torch.empty(local.value_heads, dtype=dtype))
        self.norm_weight = torch.nn.Parameter(torch.ones(shape.value_dim, dtype=dtype))
        self.linear_proj = RowParallelLinear(
            shape.value_heads * shape.value_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True,
        )  # fmt: skip
        self.number = layer_number
        """megatron's layer number (global, from 1): this layer's slot in a state cache."""
        self.mixing: Switch[Mixing] = Switch(Whole(gated_delta.TorchRule()))
        """How the layer runs its recurrence now (`ForwardPaths` installs one shared switch)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, hidden] (THD: [t, 1, hidden]) -> (out, None) like megatron's attention."""
        s = self.shape
        mixed = self.in_proj(hidden_states)[0].transpose(0, 1)  # [b, s, this rank's blocks]
        qkv, z, b, a = mixed.split([sum(s.conv_blocks), *s.in_blocks[3:]], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self.mixing.now.mix(self, qkv, g, beta, packed_seq_params)
        heads = qkv.shape[:2]
        out = self._gated_norm(out, z.reshape(*heads, s.value_heads, s.value_dim))
        out, bias = self.linear_proj(out.reshape(*heads, -1).transpose(0, 1))
        return out, bias

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict | None = None,
    ) -> dict:
        """Each TP-split block of the in-projection and the conv its own sharded tensor (as
        megatron's GatedDeltaNet does), so a checkpoint loads under another TP size."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {n: getattr(self, n) for n in ("conv_weight", "A_log", "dt_bias", "norm_weight")}
        axes = {"conv_weight": 0, "A_log": 0, "dt_bias": 0}
        state.update(sharded_params(own, prefix, axes, sharded_offsets, metadata))
        s, names = self.shape, ["query", "key", "value", "z", "b", "a"]
        for key, blocks in (("in_proj.weight", s.in_blocks), ("conv_weight", s.conv_blocks)):
            state[prefix + key] = _split_tensor_factory(
                state[prefix + key], list(blocks), names[: len(blocks)], 0
            )
        return state

    def conv(self, x: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv and silu over one run of tokens [b, s, c] (transformers'
        `causal_conv1d_fn`: in the weight's dtype, back to x's)."""
        seq = x.shape[1]
        w = self.conv_weight
        out = F.conv1d(
            x.transpose(1, 2).to(w.dtype), w, padding=w.shape[-1] - 1, groups=w.shape[0]
        )[..., :seq]
        return F.silu(out).to(x.dtype).transpose(1, 2)

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [b, s, c] -> q, k [b, s, value heads, key_dim] (the key heads
        repeated), v [b, s, value heads, value_dim]."""
        s, lead = self.shape, mixed.shape[:2]
        q, k, v = mixed.split(list(s.conv_blocks), dim=-1)
        q, k = (x.reshape(*lead, s.key_heads, s.key_dim) for x in (q, k))
        if s.value_heads > s.key_heads:
            q, k = (x.repeat_interleave(s.value_heads // s.key_heads, dim=2) for x in (q, k))
        return q, k, v.reshape(*lead, s.value_heads, s.value_dim)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head (Llama's arithmetic, `ops.rms_norm`), then times
        silu(z) in fp32 (transformers' `RMSNormGated`). Every TP rank's heads read the one
        weight: its gradient is their sum."""
        weight = copy_to_tensor_model_parallel_region(self.norm_weight)
        return (rms_norm(o, weight, self.eps) * F.silu(z.float())).to(o.dtype)


def _split(t: torch.Tensor) -> torch.nn.Parameter:
    """A parameter split over TP along dim 0 (its rows this rank's heads or channels)."""
    p = torch.nn.Parameter(t)
    set_tensor_model_parallel_attributes(p, True, 0, 1)
    return p


def _bounds(params: PackedSeqParams) -> list[int]:
    """Where a pack's sequences, each from a zero state, begin and end (padded bounds): from the
    host where the pack says them (`HostPacked`: no device read per layer), else read back."""
    if isinstance(params, HostPacked):
        return params.bounds()
    cu = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
    return cu.tolist()


class Mixing(Protocol):
    """How a Gated DeltaNet layer runs its conv and recurrence in a phase."""

    def mix(
        self,
        layer: GatedDeltaNet,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        params: PackedSeqParams | None,
    ) -> torch.Tensor:
        """The projections' qkv [b, s, c], decays and write strengths [b, s, value heads] ->
        the recurrence's output [b, s, value heads, value_dim]."""
        ...


class Whole:
    """Training and scoring: each row (or packed sequence) whole, from a zero state, by `rule`
    (our PyTorch chunked form, or flash-linear-attention's kernels on a GPU in half precision:
    `model/paths.choose_paths`)."""

    def __init__(self, rule: gated_delta.DeltaRule) -> None:
        self.rule = rule

    def mix(
        self,
        layer: GatedDeltaNet,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        params: PackedSeqParams | None,
    ) -> torch.Tensor:
        if params is None:
            return self._run(layer, qkv, g, beta, None)
        split = ContextSplit.of(params)
        if split is None:
            return self._run(layer, qkv, g, beta, _bounds(params))
        # Context parallelism: this rank's share of each sequence all-gathered into whole
        # sequences (their gradients reduce-scattered back to the owners), run whole, and this
        # rank's tokens kept. Exact; each CP rank repeats the linear layer's recurrence (the
        # attention layers' work is split).
        whole = [split.gather_keys(x[0])[None] for x in (qkv, g, beta)]
        bounds = [0, *itertools.accumulate(split.padded)]
        return self._run(layer, *whole, bounds)[:, split.plan(qkv.device).local]

    def _run(
        self,
        layer: GatedDeltaNet,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        bounds: list[int] | None,
    ) -> torch.Tensor:
        """The conv and the rule over each row (`bounds` None) or each packed sequence."""
        ends = bounds or [0, qkv.shape[1]]
        runs = [layer.conv(qkv[:, a:z]) if z > a else qkv[:, a:z] for a, z in pairwise(ends)]
        q, k, v = layer.heads(torch.cat([*runs, qkv[:, ends[-1] :]], dim=1))
        return self.rule(q, k, v, g, beta, bounds)


class StateCache:
    """Generation's state of each Gated DeltaNet layer, by layer number: the conv's window (the
    last kernel - 1 projected inputs of each row [b, kernel - 1, c]) and the recurrence's state
    [b, value heads, key_dim, value_dim] (fp32), written in place by each decode step."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class Cached:
    """Generation: the prefill runs each right-padded prompt whole (its padding neither decays
    nor writes the state) and keeps its window and state; a decode step (one token per row)
    continues them. `steps`: the generating phase, whose `step` says which forward this is."""

    def __init__(self, cache: StateCache, steps: Any) -> None:
        self.cache, self.steps = cache, steps

    def mix(
        self,
        layer: GatedDeltaNet,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        params: PackedSeqParams | None,
    ) -> torch.Tensor:
        step = self.steps.step
        if step.prefill:
            return self._prefill(layer, qkv, g, beta, step.lengths)
        window, state = self.cache.layers[layer.number]
        inputs = torch.cat([window, qkv], dim=1)  # [b, kernel, c]: the conv's last output
        q, k, v = layer.heads(layer.conv(inputs)[:, -1:])
        out, new = gated_delta.recurrent(q, k, v, g, beta, initial=state)
        window.copy_(inputs[:, 1:])
        state.copy_(new)
        return out

    def _prefill(
        self,
        layer: GatedDeltaNet,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        b, s, c = qkv.shape
        padding = (torch.arange(s, device=qkv.device)[None, :] >= lengths[:, None])[..., None]
        q, k, v = layer.heads(layer.conv(qkv))
        out, state = gated_delta.chunked(
            q, k, v, g.masked_fill(padding, 0.0), beta.masked_fill(padding, 0.0)
        )
        kernel = layer.shape.conv_kernel
        earlier = F.pad(qkv, (0, 0, kernel - 1, 0))  # position p at p + kernel - 1
        at = lengths[:, None] + torch.arange(kernel - 1, device=qkv.device)[None, :]
        window = earlier.gather(1, at[..., None].expand(b, kernel - 1, c))
        self.cache.layers[layer.number] = (window, state)
        return out
