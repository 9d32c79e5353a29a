"""One token per row from softmax(logits / T), drawn in one pass over the logits (GPU).

A decode step at batch 256 over a 128k vocabulary drew its tokens with torch's softmax and
multinomial: a copy of the logits to fp32, the softmax's two passes, multinomial's exponential
noise, division and arg max — the sampling passes that took ~0.5 ms of a 5.3 ms step of the
1.6B model in BENCHMARKS.md's profile. Here the draw is an exponential race (the Gumbel-max
trick): the token is `argmax_i(x_i / T - log E_i)` with E_i ~ Exp(1) independent, which is
exactly a draw from softmax(x / T) — no normalization, no probabilities, one read of the
logits. Each row's vocabulary is split over a few programs (`chunks_for`: about eight per
multiprocessor in all); each keeps its best key and index, and the winner of a row's chunks is
one small arg max after.

The noise is Triton's Philox counter stream at the token's id, keyed by a step seed drawn from
the call's generator (on the device: no host sync) in its low 32 bits and the row's id in its
high ones. A row's id is its index in the caller's whole batch (`generation/sampler.py`), not
its place in this call: a row draws the same tokens whichever data-parallel shard it is in and
however the rows are split into programs, and copies of one prompt draw independently. E =
-log(1 - v) of a uniform v on a 2**-31 lattice, with its series v + v²/2 where v is small: a
large key (a small E) keeps its precision instead of the coarse steps of a float32 just below 1.

`race_torch` is the same draw in torch operations (the CPU), its noise a 32-bit integer hash of
(step seed, row id, token id): other bits than Philox's, the same rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from policyworker.ops.compiled import multiprocessors

BLOCK = 2048
"""Vocabulary entries per loop iteration of a program."""
MAX_CHUNKS = 64
"""Programs per row at most."""


@triton.jit
def _race_kernel(
    x_ptr, seed_ptr, rows_ptr, key_ptr, idx_ptr, V, stride_x, chunk, chunks, inv_t,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row, part = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seed_ptr) + (tl.load(rows_ptr + row).to(tl.int64) << 32)  # Philox's key
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK], tl.int32)
    lo = part * chunk
    for start in range(lo, lo + chunk, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=inside, other=0.0)
        v = tl.rand(seed, cols) + 2.3283064e-10  # uniform on (0, 1): E = 0 would always win
        e = tl.where(v < 1e-4, v + 0.5 * v * v, -tl.log(1.0 - v))  # Exp(1)
        key = tl.where(inside, x.to(tl.float32) * inv_t - tl.log(e), float("-inf"))
        better = key > best  # NaN never wins
        best = tl.where(better, key, best)
        where = tl.where(better, cols, where)
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, where, V), 0)  # the smallest id among ties
    tl.store(key_ptr + row * chunks + part, top)
    tl.store(idx_ptr + row * chunks + part, first)


def chunks_for(rows: int, device: torch.device) -> int:
    """Programs per row: about eight per multiprocessor over all rows (5 at batch 256 on an
    H100's 132), at most `MAX_CHUNKS`."""
    return max(1, min(MAX_CHUNKS, -(-8 * multiprocessors(device) // max(rows, 1))))


def step_seed(device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """One draw's seed [1] (int64 in [0, 2**31), on `device`) from `generator` (on `device`;
    None: torch's default one): every row's noise of the step is keyed by it."""
    return torch.randint(0, 2**31, (1,), device=device, generator=generator)


def race(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    row_ids: torch.Tensor,
) -> torch.Tensor:
    """A token id [B] (int64) per row of `logits` [B, V] (last dim contiguous), drawn from
    softmax(logits / temperature) with noise from `generator` (on the logits' device; None:
    torch's default one) keyed by each row's id (`row_ids` [B], ints in [0, 2**31), on the
    logits' device)."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    seed = step_seed(logits.device, generator)
    chunks = chunks_for(rows, logits.device)
    keys = logits.new_empty((rows, chunks), dtype=torch.float32)
    ids = logits.new_empty((rows, chunks), dtype=torch.int32)
    chunk = -(-vocab // (chunks * BLOCK)) * BLOCK
    if rows:
        _race_kernel[(rows, chunks)](
            logits, seed, row_ids, keys, ids, vocab, logits.stride(0), chunk, chunks,
            1.0 / temperature, BLOCK=BLOCK,
        )  # fmt: skip
    return ids.gather(1, keys.argmax(1, keepdim=True)).squeeze(1).long()


_LOW32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32) (multiply-xorshift rounds; the
    multipliers are below 2**31, so no product leaves int64)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _LOW32
    return x ^ (x >> 16)


def race_torch(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    row_ids: torch.Tensor,
) -> torch.Tensor:
    """`race` in torch operations: the arg max of logits / T - log E, E ~ Exp(1) from a hash of
    (step seed, row id, token id), on the logits' device; -inf and NaN logits are never drawn."""
    seed = step_seed(logits.device, generator)
    rows = _mix(_mix(row_ids.long() & _LOW32) ^ seed)  # [B]
    tokens = _mix(torch.arange(logits.shape[-1], device=logits.device))  # [V]
    bits = _mix(rows[:, None] ^ tokens[None, :])  # [B, V]
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # in (0, 1)
    keys = logits.float() / temperature - torch.log(-torch.log(uniform))
    return torch.nan_to_num(keys, nan=float("-inf")).argmax(dim=-1)
