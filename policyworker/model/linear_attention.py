"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next, in megatron's
self-attention slot of a decoder layer (the hybrid pattern is a layer spec per layer:
`model/build.layer_spec`).

    x ─ linear_qkv ─ causal depthwise conv (kernel K) + silu ─ q, k, v (q/k: key heads)
      ─ linear_z, linear_b, linear_a ─ z (the output gate), β = sigmoid(b),
                                         g = −exp(A_log) · softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, β)   (`ops/gated_delta.py`; q/k repeated to the value heads)
    out = linear_proj(RMSNorm(o) · silu(z))  (the norm per value head, HF's gated arithmetic)

The arithmetic is transformers' `Qwen3_5GatedDeltaNet` (the conv in the weight's dtype, the
decay and the recurrence in fp32). Packed sequences (THD) each run from a zero state and an
empty conv window: nothing crosses a `cu_seqlens` boundary. One TP rank and no CP yet
(`hf_config.check_layout` refuses them by name).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.model.hf_config import DeltaNetShape
from policyworker.ops import gated_delta


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
        self.shape, self.eps = shape, config.layernorm_epsilon
        hidden, values = config.hidden_size, shape.value_heads * shape.value_dim

        def column(out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                hidden, out, config=config, init_method=config.init_method,
                gather_output=False, bias=False, skip_bias_add=False,
            )  # fmt: skip

        self.linear_qkv = column(shape.conv_channels)
        self.linear_z = column(values)
        self.linear_b = column(shape.value_heads)
        self.linear_a = column(shape.value_heads)
        dtype = config.params_dtype
        self.conv_weight = torch.nn.Parameter(
            torch.empty(shape.conv_channels, 1, shape.conv_kernel, dtype=dtype)
        )
        self.A_log = torch.nn.Parameter(torch.empty(shape.value_heads, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.empty(shape.value_heads, dtype=dtype))
        self.norm_weight = torch.nn.Parameter(torch.ones(shape.value_dim, dtype=dtype))
        self.linear_proj = RowParallelLinear(
            values, hidden, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, hidden] (THD: [t, 1, hidden]) -> (out, None) like megatron's attention."""
        qkv, z, b, a = (
            lin(hidden_states)[0].transpose(0, 1)
            for lin in (self.linear_qkv, self.linear_z, self.linear_b, self.linear_a)
        )  # [b, s, ...]
        spans = _spans(packed_seq_params, qkv.shape[1])
        runs = [self._conv(qkv[:, a_:z_]) if z_ > a_ else qkv[:, a_:z_] for a_, z_ in spans]
        qkv = torch.cat([*runs, qkv[:, spans[-1][1] :]], dim=1)
        s, heads = self.shape, qkv.shape[:2]
        keys = s.key_heads * s.key_dim
        q, k, v = qkv.split([keys, keys, s.value_heads * s.value_dim], dim=-1)
        q, k = (x.reshape(*heads, s.key_heads, s.key_dim) for x in (q, k))
        v = v.reshape(*heads, s.value_heads, s.value_dim)
        if s.value_heads > s.key_heads:
            q, k = (x.repeat_interleave(s.value_heads // s.key_heads, dim=2) for x in (q, k))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if packed_seq_params is None:
            out = gated_delta.chunked(q, k, v, g, beta)[0]
        else:
            out = gated_delta.packed(q, k, v, g, beta, [a_ for a_, _ in spans] + [spans[-1][1]])
        out = self._gated_norm(out, z.reshape(*heads, s.value_heads, s.value_dim))
        out, bias = self.linear_proj(out.reshape(*heads, -1).transpose(0, 1))
        return out, bias

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv and silu over one run of tokens [b, s, c] (transformers'
        `causal_conv1d_fn`: in the weight's dtype, back to x's)."""
        seq = x.shape[1]
        w = self.conv_weight
        out = F.conv1d(
            x.transpose(1, 2).to(w.dtype), w, padding=w.shape[-1] - 1, groups=w.shape[0]
        )[..., :seq]
        return F.silu(out).to(x.dtype).transpose(1, 2)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head, then times silu(z) (transformers' `RMSNormGated`)."""
        dtype = o.dtype
        o32 = o.float()
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm_weight * o32.to(dtype)
        return (out * F.silu(z.float())).to(dtype)


def _spans(params: PackedSeqParams | None, tokens: int) -> list[tuple[int, int]]:
    """The runs of tokens each starting from a zero state: a padded batch's whole rows, or a
    pack's sequences (by `cu_seqlens`, padded bounds where given)."""
    if params is None:
        return [(0, tokens)]
    cu = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
    bounds = cu.tolist()
    return [(a, z) for a, z in itertools.pairwise(bounds)]
