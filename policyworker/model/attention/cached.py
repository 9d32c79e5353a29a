"""Attention over a KV cache: generation's phase (`Generating`) and its kernels.

A generate call installs one `Generating` phase for all layers; before each forward the decoder
says what it feeds (`begin`: a `Step`) and where its tokens go (`locate`, inside a captured CUDA
graph when there is one). Each layer then writes its new keys and values (after RoPE) into the
cache at each row's positions (`CacheWrite`) and attends to the row's cached keys up to each
query's position with the step's kernel: the prefill's (every row from position 0: plainly
causal) or a decode step's (one token per row at its own position). The kernels are chosen once
(`model/paths.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch.nn.attention import SDPBackend, sdpa_kernel

from policyworker.model.attention.cache import KVCache, Step
from policyworker.model.attention.core import CoreAttention
from policyworker.model.attention.layout import CachedKernel
from policyworker.model.attention.rotary import Rotary
from policyworker.ops.decode_attention import attention_rows, decode_attention
from policyworker.ops.rope import rope_into_cache

# Not cuDNN: it builds an execution plan for every new shape (~50 ms on an H200), and every
# decode step has a new key length, every prefill a new prompt width. SDPA's decode
# (`sdpa_decode`) takes the memory-efficient kernel (flash takes no mask): it reads the cache at
# ~0.5 TB/s on an H200 (64-row query tiles for a step's few rows), the math backend was 3.4x
# slower still; our own kernel (`triton_decode`, the default) reads each row's keys only.
_PREFILL = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_DECODE = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """The prefill (every row from 0): plainly causal SDPA."""
    with sdpa_kernel(_PREFILL, set_priority=True):
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def rows_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """The prefill under `batch_invariant`: `attention_rows`, as scoring runs it."""
    return attention_rows(q, k, v, scale)


def sdpa_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """A decode step as SDPA under a mask of keys <= each query's position."""
    with sdpa_kernel(_DECODE, set_priority=True):
        return masked_grouped(q, k, v, positions, scale)


def triton_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    one_split: bool = False,
) -> torch.Tensor:
    """A decode step (one token per row) through `ops.decode_attention`'s kernel, which reads
    each row's written keys only; `one_split`: each row's keys in one program, in order —
    bitwise what `attention_rows` gives at that position."""
    assert q.shape[2] == 1, "triton_decode: one query token per row"
    out = decode_attention(q[:, :, 0], k, v, positions[0], scale, one_split=one_split)
    return out[:, :, None]


invariant_decode: CachedKernel = functools.partial(triton_decode, one_split=True)
"""A decode step under `batch_invariant`: bitwise the prefill's and scoring's `attention_rows`
at the step's position."""


def masked_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [b, np, s, hn] against k/v [b, ng, n, hn] (v's width may differ: MLA), each query
    reaching the keys up to its position ([s, b]). The query heads sharing a key head (megatron's and SDPA's grouping:
    head j reads key head j // (np / ng)) become extra query rows of that key head, so no
    repeated copy of the keys is made (a decode step would otherwise copy the whole cache)."""
    b, heads, s, hn = q.shape
    groups, n = k.shape[1], k.shape[2]
    rep = heads // groups
    reach = torch.arange(n, device=q.device)[None, None, :] <= positions.T[:, :, None]  # [b,s,n]
    mask = reach[:, None, None].expand(b, 1, rep, s, n).reshape(b, 1, rep * s, n)
    grouped = q.reshape(b, groups, rep * s, hn)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, s, v.shape[-1])


@dataclass(frozen=True, slots=True)
class Where:
    """Where a forward's new tokens go, the same in every layer: positions [s, b], row indices
    [s, b] and RoPE's (cos, sin) at the positions ([s, b, 1, hn])."""

    positions: torch.Tensor
    rows: torch.Tensor
    angles: tuple[torch.Tensor, torch.Tensor]


class CacheWrite(Protocol):
    """RoPE of a forward's new queries and keys, and its keys and values into the cache;
    -> the rotated queries."""

    def __call__(
        self,
        layer: CoreAttention,
        cache: KVCache,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        where: Where,
    ) -> torch.Tensor: ...


class PlainWrite:
    """`CacheWrite` as four torch ops."""

    def __call__(
        self,
        layer: CoreAttention,
        cache: KVCache,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        where: Where,
    ) -> torch.Tensor:
        query, key, value = qkv
        query, key = layer.rotary(query, where.angles), layer.rotary(key, where.angles)
        cache.write(layer.number, key, value, where.rows, where.positions)
        return query


class FusedWrite:
    """`CacheWrite` as one Triton kernel (`rope_into_cache`; the queries rotated in place):
    where our kernels run (a GPU, or Triton's interpreter)."""

    def __call__(
        self,
        layer: CoreAttention,
        cache: KVCache,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        where: Where,
    ) -> torch.Tensor:
        query, key, value = qkv
        kv = cache.layer(layer.number, key, value)
        rope_into_cache(query, key, value, where.angles, where.positions, kv)
        return query


class Generating:
    """Generation's phase: every layer writes to and attends over `cache`."""

    def __init__(
        self,
        cache: KVCache,
        prefill: CachedKernel,
        decode: CachedKernel,
        write: CacheWrite,
        rotary: Rotary,
        dtype: torch.dtype,
    ) -> None:
        self.cache = cache
        self.prefill, self.decode, self.write = prefill, decode, write
        self.rotary, self.dtype = rotary, dtype
        self.step: Step | None = None
        self.where: Where | None = None

    def begin(self, step: Step) -> None:
        """What the next forwards feed (a local decode loop keeps one step, updated in place)."""
        self.step = step

    def locate(self, s: int) -> torch.Tensor:
        """The next forward's `Where` for `s` tokens per row from the step's starts, made once
        for every layer (inside the forward a CUDA graph captures); -> its positions [s, b]."""
        assert self.step is not None, "Generating: begin() a step first"
        starts = self.step.starts
        arange = torch.arange(s, device=starts.device)
        positions = starts[None, :] + arange[:, None]
        rows = torch.arange(starts.shape[0], device=starts.device)[None, :].expand(s, -1)
        self.where = Where(positions, rows, self.rotary.angles(positions[..., None], self.dtype))
        return positions

    def attend(
        self,
        layer: CoreAttention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams | None,
    ) -> torch.Tensor:
        """Queries [s, b, np, hn] of the step's new tokens against the cached keys, after
        writing the new keys/values [s, b, ng, hn]; -> [s, b, np * hn]."""
        step, where = self.step, self.where
        assert step is not None and where is not None, "Generating: locate() each forward"
        s, b = query.shape[:2]
        query = self.write(layer, self.cache, (query, key, value), where)
        k, v = self.cache.read(layer.number, step.keys_used)
        kernel = layer.softmax.cached(self.prefill if step.prefill else self.decode)
        out = kernel(query.permute(1, 2, 0, 3), k, v, where.positions, layer.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
