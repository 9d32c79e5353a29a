"""Core attention on torch SDPA, for megatron-core's SelfAttention without Transformer Engine.

Two layouts, as megatron hands them over:
* padded (sbhd): query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn];
* packed (thd, `packed_seq_params.qkv_format == "thd"`): query [t, np, hn], key/value [t, ng, hn]
  with cu_seqlens -> [t, np*hn]. On GPU in bf16/fp16 this is
  `torch.nn.attention.varlen.varlen_attn` (flash); otherwise SDPA runs on chunks of sequences
  under a block-diagonal causal mask, which is exact.

Attention is always causal; the mask megatron passes is ignored (right padding never leaks into
earlier positions under a causal mask).

RoPE is applied here, to the queries and keys megatron hands over (after the q/k norms, as in HF),
with HF's exact frequencies (`set_rope`): positions 0..S-1 padded, and restarting at every
sequence packed — one vectorized op either way (megatron's own THD RoPE loops over sequences).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.ops.compiled import triton_runs
from policyworker.ops.decode_attention import attention_rows
from policyworker.ops.packed import packed_positions
from policyworker.ops.rope import rope
from policyworker.parallel.context import ContextPlan, ContextSplit

if TYPE_CHECKING:
    from policyworker.model.kv_cache import LayerCache


IN_PLACE_ROWS = 4096
"""An inference forward (eval mode, no gradient) over more rows (tokens) than this rotates its
input in place, this many rows at a time: at 128k tokens the rotated queries were the largest
avoidable tensor of the peak. Not in training mode: a recomputed layer's first, gradient-free
pass must leave what it will recompute from untouched."""


def _rope_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope` written over x, a chunk of rows at a time (temporaries of one chunk). What
    megatron hands over — its own copy of the queries, views of the QKV output for the keys —
    is read by nothing after attention."""
    n = x.shape[0]
    for a in range(0, n, IN_PLACE_ROWS):
        rows = slice(a, a + IN_PLACE_ROWS)
        c, s = (t[rows] if t.shape[0] == n else t for t in (cos, sin))
        x[rows] = rope(x[rows], c, s)
    return x


class Rotary(torch.nn.Module):
    """RoPE of queries or keys, as HF computes it; a module of its own so that what leaves it
    (the queries and keys attention and a KV cache see) can be observed with hooks. Called
    for the queries, then the keys, in every attention forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor | None = None  # not a buffer: no checkpoint or phase state

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin at `positions` (broadcast over x's head dims), with
        cos/sin computed in fp32 and cast to x's dtype, as HF and megatron do; `angles`: those
        (cos, sin), already made by `angles()` for these positions."""
        cos, sin = self.angles(positions, x.dtype) if angles is None else angles
        if self.training or torch.is_grad_enabled() or x.shape[0] <= IN_PLACE_ROWS:
            return rope(x, cos, sin)
        return _rope_in_place(x, cos, sin)

    def angles(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at `positions` [..., 1], [..., head_dim] in `dtype`."""
        if self.inv_freq is None:
            raise RuntimeError("SDPACoreAttention: set_rope() was not called")
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


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
        head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.rotary = Rotary()
        self.rows = False
        """`batch_invariant`: without gradient, attention is `attention_rows` where Triton runs
        (a decode step's arithmetic, row by row), else SDPA / flash."""
        self.kv_cache: LayerCache | None = None
        """Set while the worker generates (`model.kv_cache.attached`): padded rows only."""

    def set_rope(self, inv_freq: torch.Tensor) -> None:
        """RoPE inverse frequencies [head_dim / 2] (fp32), applied to queries and keys."""
        self.rotary.inv_freq = inv_freq

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
        if self.kv_cache is not None:
            return self.kv_cache.attend(query, key, value, self.rotary, self.softmax_scale)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            split = ContextSplit.of(packed_seq_params)
            if split is not None:
                out = self._context_parallel(query, key, value, split)
                return out.reshape(out.shape[0], -1)
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            positions = packed_positions(cu, query.shape[0])[:, None]  # [t, 1]
            query, key = self._rotate(query, key, positions)
            if self._by_rows(query):
                out = _rows_thd(query, key, value, cu, self.softmax_scale)
            else:
                out = self._thd(query, key, value, packed_seq_params)  # [t, np, hn]
            return out.reshape(out.shape[0], -1)
        positions = torch.arange(query.shape[0], device=query.device)[:, None, None]  # [s, 1, 1]
        query, key = self._rotate(query, key, positions)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if self._by_rows(query):
            out = attention_rows(q, k, v, self.softmax_scale)
        else:
            bucketed = _half_on_gpu(query)
            out = causal_sdpa(q, k, v, self.softmax_scale, dropout_p, bucketed=bucketed)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _by_rows(self, x: torch.Tensor) -> bool:
        return self.rows and not torch.is_grad_enabled() and triton_runs(x)

    def _rotate(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of the queries and the keys, their (cos, sin) made once for both."""
        angles = self.rotary.angles(positions, query.dtype)
        return self.rotary(query, positions, angles), self.rotary(key, positions, angles)

    def _context_parallel(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, split: ContextSplit
    ) -> torch.Tensor:
        """This rank's queries [t, np, hn] against every rank's keys and values.

        RoPE uses each local token's position in its whole sequence; keys and values are
        all-gathered into sequence order; each of the rank's query blocks (two chunks per
        sequence) attends to its sequence's keys up to the block's end, causally (the mask
        aligned to the lower right). Everything the layer indexes with was made once per
        micro-batch (`ContextPlan`): no host sync here. On GPU in half precision the blocks are
        one flash varlen call; otherwise one exact masked SDPA per block."""
        plan = split.plan(query.device)
        query, key = self._rotate(query, key, plan.positions[:, None])
        key, value = split.gather_keys(key), split.gather_keys(value)  # [T, ng, hn]
        if _half_on_gpu(query):
            return _context_blocks_cuda(query, key, value, plan, self.softmax_scale)
        return _context_blocks_reference(query, key, value, plan, self.softmax_scale)

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
        if _half_on_gpu(query):
            if params.max_seqlen_q is not None and int(params.max_seqlen_q) == query.shape[0]:
                return _one_sequence(query, key, value, self.softmax_scale)
            return _varlen_cuda(query, key, value, cu_q, cu_k, params, self.softmax_scale)
        return _varlen_reference(query, key, value, cu_q, self.softmax_scale)


def _rows_thd(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attention_rows` within each packed sequence ([t, h, d] in and out), one launch per
    sequence: a sequence's key blocks start at its first token, as a decode step's do."""
    out = torch.zeros_like(query)
    for a, b in itertools.pairwise(cu.tolist()):
        if b > a:
            q, k, v = (x[a:b].transpose(0, 1)[None] for x in (query, key, value))
            out[a:b] = attention_rows(q, k, v, scale)[0].transpose(0, 1)
    return out


SDPA_BUCKET = 1024


def bucketed_length(s: int) -> int:
    """s rounded up so that the lengths a run meets share few kernel plans: to a power of two
    up to `SDPA_BUCKET` tokens, then to a multiple of it (at most 1023 more tokens: 6% at 16k)."""
    quantum = min(SDPA_BUCKET, 1 << (s - 1).bit_length()) if s > 1 else 1
    return -(-s // quantum) * quantum


def causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
    bucketed: bool = False,
) -> torch.Tensor:
    """Causal attention of queries [b, np, s, hn] over keys/values [b, ng, s, hn]. `bucketed`
    pads s at the end to `bucketed_length(s)` and drops the padding's output, which is exact
    for every real token under a causal mask. On Hopper torch runs cuDNN's attention here, which
    builds a graph per new shape (~130 ms each on an H100: `benchmarks/attention_bench.py`),
    and an RL batch's lengths all differ: bucketed, a run builds one per 1024 tokens of length."""
    s = q.shape[2]
    pad = bucketed_length(s) - s if bucketed else 0
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        dropout_p=dropout_p,
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[:, :, :s] if pad else out


def _half_on_gpu(x: torch.Tensor) -> bool:
    """Whether attention on x takes the GPU's half-precision kernels (flash varlen, cuDNN)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _one_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """A pack that one (padded) sequence fills — every long sequence — as bucketed causal SDPA
    on one row: cuDNN's attention, 1.5x the varlen kernel forward and backward at 16k-32k
    tokens on an H100. The padding after the sequence attends causally too and is dropped."""
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, h, t, d]
    return causal_sdpa(q, k, v, scale, bucketed=True)[0].transpose(0, 1)


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

    # Flash takes grouped keys/values as they are (heads divide); repeating them would cost a
    # device sync per call (repeat_interleave sizes its output on the host) and the memory.
    max_q = (
        int(params.max_seqlen_q)
        if params.max_seqlen_q is not None
        else int((cu_q[1:] - cu_q[:-1]).max())
    )
    max_k = int(params.max_seqlen_kv) if params.max_seqlen_kv is not None else max_q
    return varlen_attn(
        query, key, value, cu_q.int(), cu_k.int(), max_q, max_k, scale=scale, window_size=(-1, 0)
    )


def _context_blocks_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ContextPlan, scale: float
) -> torch.Tensor:
    """Every query block against its keys in one flash varlen call: each block's keys are
    gathered after one another (`key_index`), and flash's causal mask for fewer queries than
    keys is aligned to the lower right — exactly "up to the block's end"."""
    from torch.nn.attention.varlen import varlen_attn

    k, v = key[plan.key_index], value[plan.key_index]
    return varlen_attn(
        query,
        k,
        v,
        plan.cu_q,
        plan.cu_k,
        plan.max_q,
        plan.max_k,
        scale=scale,
        window_size=(-1, 0),
    )


def _context_blocks_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ContextPlan, scale: float
) -> torch.Tensor:
    """Every query block against its keys, one masked SDPA each: exact (CPU, fp32), and the
    GPU path's reference."""
    out = torch.empty_like(query)
    row = 0
    for start, chunk, i in plan.blocks:
        q = query[row : row + chunk].transpose(0, 1)  # [h, c, d]
        end = (i + 1) * chunk
        k, v = (x[start : start + end].transpose(0, 1) for x in (key, value))
        q_pos = torch.arange(i * chunk, end, device=q.device)
        mask = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
        )
        out[row : row + chunk] = o.transpose(0, 1)
        row += chunk
    return out


_CHUNK_TOKENS = 256  # the CPU path's chunks: few SDPA calls, little attention to masked pairs


def _varlen_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention within each packed sequence, exact: the CPU path, and the GPU path's
    reference. Consecutive sequences are grouped into chunks of up to `_CHUNK_TOKENS` tokens and
    each chunk is one SDPA call under a block-diagonal causal mask (a longer sequence runs alone,
    plainly causal); tokens after the last sequence get zeros."""
    out = torch.zeros_like(query)
    for group in _chunks([(a, b) for a, b in itertools.pairwise(cu.tolist()) if b > a]):
        start, end = group[0][0], group[-1][1]
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [h, t, d]
        mask = None
        if len(group) > 1:
            lengths = torch.tensor([b - a for a, b in group], device=query.device)
            seq = torch.repeat_interleave(torch.arange(len(group), device=query.device), lengths)
            mask = (seq[:, None] == seq[None, :]).tril()
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[0] != k.shape[0],
        )
        out[start:end] = o.transpose(0, 1)
    return out


def _chunks(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Consecutive spans grouped while a group stays within `_CHUNK_TOKENS` tokens."""
    groups: list[list[tuple[int, int]]] = []
    for span in spans:
        if groups and span[1] - groups[-1][0][0] <= _CHUNK_TOKENS:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups
