"""Core attention on torch SDPA, for megatron-core's SelfAttention without Transformer Engine.

Two layouts, as megatron hands them over:
* padded (sbhd): query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn];
* packed (thd, `packed_seq_params.qkv_format == "thd"`): query [t, np, hn], key/value [t, ng, hn]
  with cu_seqlens -> [t, np*hn]. On GPU in bf16/fp16 this is
  `torch.nn.attention.varlen.varlen_attn` (flash); otherwise each sequence runs through SDPA on
  its own, which is exact and simple.

Attention is always causal; the mask megatron passes is ignored (right padding never leaks into
earlier positions under a causal mask).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's `DotProductAttention` (same constructor and forward signature)."""

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
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention: context parallelism is a later issue")
        head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

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
            raise NotImplementedError("SDPACoreAttention: attention_bias is not supported")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = self._thd(query, key, value, packed_seq_params)  # [t, np, hn]
            return out.reshape(out.shape[0], -1)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout_p,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _thd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        cu_q = (
            params.cu_seqlens_q_padded
            if params.cu_seqlens_q_padded is not None
            else params.cu_seqlens_q
        )
        cu_k = (
            params.cu_seqlens_kv_padded
            if params.cu_seqlens_kv_padded is not None
            else params.cu_seqlens_kv
        )
        # flash varlen kernels take only half precision; fp32 uses the exact per-sequence path.
        if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
            return _varlen_cuda(query, key, value, cu_q, cu_k, params, self.softmax_scale)
        return _varlen_reference(query, key, value, cu_q, self.softmax_scale)


def _varlen_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    params: PackedSeqParams,
    scale: float,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # the flash varlen entry point wants equal head counts
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    max_q = (
        int(params.max_seqlen_q)
        if params.max_seqlen_q is not None
        else int((cu_q[1:] - cu_q[:-1]).max())
    )
    max_k = int(params.max_seqlen_kv) if params.max_seqlen_kv is not None else max_q
    return varlen_attn(
        query, key, value, cu_q.int(), cu_k.int(), max_q, max_k, scale=scale, window_size=(-1, 0)
    )


def _varlen_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float
) -> torch.Tensor:
    """One causal SDPA per packed sequence: the CPU path, and the GPU path's reference."""
    out = torch.zeros_like(query)
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        if end == start:
            continue
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [h, s, d]
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
        )
        out[start:end] = o.transpose(0, 1)
    return out
