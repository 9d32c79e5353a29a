"""A KV cache for generation in the worker, kept by our core attention (`SDPACoreAttention`).

megatron's static inference caches keys before RoPE is applied and hands the core attention
positions it does not have; RoPE here lives in the core attention, so the cache does too: each
attention layer of this rank gets a `LayerCache` (`attached`), and every forward of the model
then writes its new keys and values (after RoPE) into the cache at each row's positions and
attends to the row's cached keys up to each query's position.

Rows are right-padded prompts of different lengths, decoded in lockstep. The prefill runs the
padded prompts (positions 0..L-1, plainly causal: a row's padding only writes slots that its
own later tokens overwrite before anything reads them); each decode step then feeds one token
per row at that row's own position (`Step.starts`) under a mask of keys <= that position.
Slots are zeros until written, so a masked slot never brings NaN into the attention.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from policyworker.model.attention import SDPACoreAttention
from policyworker.ops.compiled import triton_runs
from policyworker.ops.decode_attention import attention_rows, decode_attention
from policyworker.ops.rope import rope_into_cache

# Not cuDNN: it builds an execution plan for every new shape (~50 ms on an H200), and every
# decode step has a new key length, every prefill a new prompt width. SDPA's decode
# (`sdpa_decode`) takes the memory-efficient kernel (flash takes no mask): it reads the cache at
# ~0.5 TB/s on an H200 (64-row query tiles for a step's few rows), the math backend was 3.4x
# slower still; our own kernel (`triton_decode`, the default) reads each row's keys only.
_PREFILL = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_DECODE = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
KEY_BLOCK = 64
"""Key lengths a forward attends to are multiples of this: aligned masks, few shapes."""


@dataclass(slots=True)
class Step:
    """What the next forward feeds: each row's first new position [B] (int64, on the device),
    how many positions the queries may reach at most (a host int), and whether it is the
    prefill (every row from position 0)."""

    starts: torch.Tensor
    keys_used: int
    prefill: bool


@dataclass(frozen=True, slots=True)
class _Where:
    """Where a forward's new tokens go, the same in every layer: positions [s, b], row indices
    [s, b] (for writing the cache) and RoPE's (cos, sin) at the positions."""

    positions: torch.Tensor
    rows: torch.Tensor
    angles: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, step: Step, rotary: torch.nn.Module, query: torch.Tensor) -> _Where:
        s, b = query.shape[:2]
        positions = step.starts[None, :] + torch.arange(s, device=query.device)[:, None]
        rows = torch.arange(b, device=query.device)[None, :].expand(s, b)
        return cls(positions, rows, rotary.angles(positions[..., None], query.dtype))


class KVCache:
    """Keys and values of a batch's rows, up to `capacity` positions each (rounded up to a multiple
    of `KEY_BLOCK`), for every attention layer of this rank; layer tensors are made at their
    first write."""

    def __init__(self, capacity: int, decode: DecodeAttention, *, rows: bool = False) -> None:
        self.capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        self.decode = decode
        """A decode step's attention (`DECODE`)."""
        self.rows = rows
        """The prefill's attention is `attention_rows` where Triton runs (`batch_invariant`)."""
        self.step: Step | None = None
        self.layers: list[LayerCache] = []
        self.where: _Where | None = None
        """The current forward's positions and RoPE angles, made by its first layer."""

    def layer(self) -> LayerCache:
        cache = LayerCache(self)
        self.layers.append(cache)
        return cache

    def reach(self, positions: int) -> int:
        """The key length a forward attends to when its queries reach `positions` positions:
        rounded up to a multiple of `KEY_BLOCK` (masked beyond)."""
        return min(self.capacity, -(-positions // KEY_BLOCK) * KEY_BLOCK)


class LayerCache:
    """One attention layer's keys and values [B, kv_heads, capacity, head_dim]."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rotary: torch.nn.Module,
        scale: float,
    ) -> torch.Tensor:
        """Queries [s, b, np, hn] of the step's new tokens against the cached keys, after
        writing the new keys/values [s, b, ng, hn]; -> [s, b, np * hn]."""
        step = self.owner.step
        assert step is not None, "KVCache: no step set"
        s, b = query.shape[:2]
        if self is self.owner.layers[0]:  # made once per forward, the same for every layer
            self.owner.where = _Where.of(step, rotary, query)
        where = self.owner.where
        assert where is not None
        if self.keys is None:
            shape = (b, key.shape[2], self.owner.capacity, key.shape[3])
            self.keys, self.values = key.new_zeros(shape), value.new_zeros(shape)
        assert self.values is not None
        positions = where.positions
        if triton_runs(query):  # one kernel for the four below (a decode step's small kernels)
            cache = (self.keys, self.values)
            rope_into_cache(query, key, value, where.angles, positions, cache)  # query in place
        else:
            at, angles = positions[..., None], where.angles
            query, key = rotary(query, at, angles), rotary(key, at, angles)
            self.keys[where.rows, :, positions] = key  # advanced indices first: [s, b, ng, hn]
            self.values[where.rows, :, positions] = value
        n = step.keys_used
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        q = query.permute(1, 2, 0, 3)  # [b, np, s, hn]
        if step.prefill and self.owner.rows and triton_runs(q):
            out = attention_rows(q, k, v, scale)
        elif step.prefill:  # every row from 0: plainly causal
            with sdpa_kernel(_PREFILL, set_priority=True):
                gqa = q.shape[1] != k.shape[1]
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
                )
        else:
            out = self.owner.decode(q, k, v, positions, scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def sdpa_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [b, np, s, hn] of a decode step against the cache's k/v [b, ng, n, hn], each query
    reaching the keys up to its position ([s, b]): SDPA under a mask. -> [b, np, s, hn]."""
    with sdpa_kernel(_DECODE, set_priority=True):
        return _masked_grouped(q, k, v, positions, scale)


def triton_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    one_split: bool = False,
) -> torch.Tensor:
    """`sdpa_decode` through `ops.decode_attention`'s kernel when a step feeds one token per
    row and Triton can run it — on a GPU, or on the CPU in Triton's interpreter (the tests);
    else SDPA. The kernel reads each row's written keys only; `one_split`: each row's keys in
    one program, in order — bitwise what `attention_rows` gives at that position."""
    if not triton_runs(q) or q.shape[2] != 1:
        return sdpa_decode(q, k, v, positions, scale)
    out = decode_attention(q[:, :, 0], k, v, positions[0], scale, one_split=one_split)
    return out[:, :, None]


DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
DECODE: dict[str, DecodeAttention] = {"sdpa": sdpa_decode, "triton": triton_decode}
"""`generation.decode_attention`'s choices."""
INVARIANT_DECODE: DecodeAttention = functools.partial(triton_decode, one_split=True)
"""A decode step's attention under `batch_invariant`, whatever `generation.decode_attention`
says: bitwise the prefill's and scoring's `attention_rows` at the step's position."""


def _masked_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [b, np, s, hn] against k/v [b, ng, n, hn], each query reaching the keys up to its
    position ([s, b]). The query heads sharing a key head (megatron's and SDPA's grouping:
    head j reads key head j // (np / ng)) become extra query rows of that key head, so no
    repeated copy of the keys is made (a decode step would otherwise copy the whole cache)."""
    b, heads, s, hn = q.shape
    groups, n = k.shape[1], k.shape[2]
    rep = heads // groups
    reach = torch.arange(n, device=q.device)[None, None, :] <= positions.T[:, :, None]  # [b,s,n]
    mask = reach[:, None, None].expand(b, 1, rep, s, n).reshape(b, 1, rep * s, n)
    grouped = q.reshape(b, groups, rep * s, hn)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, s, hn)


@contextlib.contextmanager
def attached(model: torch.nn.Module, cache: KVCache) -> Iterator[KVCache]:
    """Every core attention of `model` keeps its keys and values in `cache` until exit."""
    cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    for core in cores:
        core.kv_cache = cache.layer()
    try:
        yield cache
    finally:
        for core in cores:
            core.kv_cache = None
        cache.layers.clear()
