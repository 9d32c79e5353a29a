"""Attention kernels over a forward's own tokens: three implementations of `Kernels`, one chosen
per phase when the model is built (`model/paths.py`).

* `Exact`: SDPA on the exact paths (the CPU, fp32 anywhere): packed sequences in chunks under a
  block-diagonal causal mask, CP query blocks one masked SDPA each. The GPU paths' reference.
* `Flash`: a GPU in bf16/fp16: cuDNN's SDPA on bucketed lengths, flash varlen for packs and CP.
* `ByRows`: `batch_invariant` scoring (no gradient): `attention_rows`, the arithmetic of a decode
  step row by row, so generation reproduces scoring bitwise.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from policyworker.model.attention.layout import Packed
from policyworker.ops.decode_attention import attention_rows
from policyworker.parallel.context import ContextPlan

SDPA_BUCKET = 1024


def bucketed_length(s: int) -> int:
    """s rounded up so that the lengths a run meets share few kernel plans: to a power of two
    up to `SDPA_BUCKET` tokens, then to a multiple of it (at most 1023 more tokens: 6% at 16k)."""
    quantum = min(SDPA_BUCKET, 1 << (s - 1).bit_length()) if s > 1 else 1
    return -(-s // quantum) * quantum


def causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bucketed: bool = False
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
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return out[:, :, :s] if pad else out


class Exact:
    """SDPA on exact paths: the CPU, and fp32 on a GPU."""

    def padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return causal_sdpa(q, k, v, scale)

    def packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Packed, scale: float
    ) -> torch.Tensor:
        return varlen_reference(q, k, v, where.cu_q, scale)

    def split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextPlan, scale: float
    ) -> torch.Tensor:
        return context_blocks_reference(q, k, v, plan, scale)


class Flash:
    """A GPU's half-precision kernels: cuDNN SDPA (bucketed lengths) and flash varlen."""

    def padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return causal_sdpa(q, k, v, scale, bucketed=True)

    def packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Packed, scale: float
    ) -> torch.Tensor:
        max_q = where.params.max_seqlen_q
        if max_q is not None and int(max_q) == q.shape[0]:
            return one_sequence(q, k, v, scale)
        return varlen_cuda(q, k, v, where.cu_q, where.cu_k, where.params, scale)

    def split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextPlan, scale: float
    ) -> torch.Tensor:
        return context_blocks_cuda(q, k, v, plan, scale)


class ByRows:
    """`attention_rows` (our Triton kernel: a GPU, or Triton's interpreter): batch-invariant
    scoring. Context parallelism is refused by the config (`batch_invariant`)."""

    def padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return attention_rows(q, k, v, scale)

    def packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Packed, scale: float
    ) -> torch.Tensor:
        """One launch per packed sequence: its key blocks start at its first token, as a decode
        step's do."""
        out = torch.zeros_like(q)
        for a, b in itertools.pairwise(where.cu_q.tolist()):
            if b > a:
                qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
                out[a:b] = attention_rows(qs, ks, vs, scale)[0].transpose(0, 1)
        return out

    def split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextPlan, scale: float
    ) -> torch.Tensor:
        raise NotImplementedError("batch_invariant attention under context parallelism")


def one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A pack that one (padded) sequence fills — every long sequence — as bucketed causal SDPA
    on one row: cuDNN's attention, 1.5x the varlen kernel forward and backward at 16k-32k
    tokens on an H100. The padding after the sequence attends causally too and is dropped."""
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, h, t, d]
    return causal_sdpa(q, k, v, scale, bucketed=True)[0].transpose(0, 1)


def varlen_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    params: PackedSeqParams,
    scale: float,
) -> torch.Tensor:
    """Flash varlen over the packed sequences. It takes grouped keys/values as they are (heads
    divide); repeating them would cost a device sync per call (repeat_interleave sizes its output
    on the host) and the memory."""
    from torch.nn.attention.varlen import varlen_attn

    max_q = (
        int(params.max_seqlen_q)
        if params.max_seqlen_q is not None
        else int((cu_q[1:] - cu_q[:-1]).max())
    )
    max_k = int(params.max_seqlen_kv) if params.max_seqlen_kv is not None else max_q
    return varlen_attn(
        q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, scale=scale, window_size=(-1, 0)
    )


def context_blocks_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ContextPlan, scale: float
) -> torch.Tensor:
    """Every query block against its keys in one flash varlen call: each block's keys are
    gathered after one another (`key_index`), and flash's causal mask for fewer queries than
    keys is aligned to the lower right — exactly "up to the block's end"."""
    from torch.nn.attention.varlen import varlen_attn

    k, v = key[plan.key_index], value[plan.key_index]
    cu_q, cu_k, max_q, max_k = plan.cu_q, plan.cu_k, plan.max_q, plan.max_k
    return varlen_attn(query, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))


def context_blocks_reference(
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


def varlen_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention within each packed sequence, exact: the CPU path, and the GPU path's
    reference. Consecutive sequences are grouped into chunks of up to `_CHUNK_TOKENS` tokens and
    each chunk is one SDPA call under a block-diagonal causal mask (a longer sequence runs alone,
    plainly causal); tokens after the last sequence get zeros."""
    out = torch.zeros_like(query)
    for group in chunk_spans([(a, b) for a, b in itertools.pairwise(cu.tolist()) if b > a]):
        start, end = group[0][0], group[-1][1]
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [h, t, d]
        mask = same_sequence(group, query.device).tril() if len(group) > 1 else None
        gqa = q.shape[0] != k.shape[0]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        out[start:end] = o.transpose(0, 1)
    return out


def same_sequence(group: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """[t, t]: whether two tokens of a chunk of consecutive sequences (`group`'s spans) belong
    to the same sequence."""
    lengths = torch.tensor([b - a for a, b in group], device=device)
    seq = torch.repeat_interleave(torch.arange(len(group), device=device), lengths)
    return seq[:, None] == seq[None, :]


def chunk_spans(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Consecutive spans grouped while a group stays within `_CHUNK_TOKENS` tokens."""
    groups: list[list[tuple[int, int]]] = []
    for span in spans:
        if groups and span[1] - groups[-1][0][0] <= _CHUNK_TOKENS:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups
