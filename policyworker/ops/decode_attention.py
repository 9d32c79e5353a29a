"""Decode attention over a KV cache: one query token per row, a Triton split-K kernel.

A decode step's attention reads every cached key and value of every row once and does little
arithmetic with them, so its speed is the rate it reads the cache. SDPA's kernels are built for
many queries: the memory-efficient one tiles 64 query rows for a step's few (the query heads of
one key head), takes the mask as a dense tensor and reads every slot up to the key length it is
given — under a CUDA graph that is the cache's whole capacity, however short the rows still are.
This kernel reads only each row's written keys (its length is read on the device, so one
captured graph serves every step), puts the query heads that share a key head in one tile, and
splits a row's keys over several programs when rows x key heads are too few to fill the GPU
(flash-decoding); the splits' partial softmax sums are merged after, by a second kernel.

Numbers: fp32 scores and sums (exact to rounding against SDPA in fp32: the dot products run in
IEEE fp32 for fp32 inputs); bf16/fp16 probabilities are rounded to the input dtype before the
product with the values, as flash attention does.

`attention_rows` is causal attention over a whole sequence computed the way a decode step
computes one position: the same loop over the same key blocks (`_attend`) on the same tiles. So
its row t is bitwise a one-split decode step at position t over the same keys — the attention
half of a generation whose logprobs equal scoring's exactly (the rest: row-wise norms and
elementwise ops, and GEMMs whose bits do not depend on their row count): the model's attention
without gradient under `batch_invariant` (`model/paths.py` chooses it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from policyworker.ops.compiled import multiprocessors

BLOCK_N = 128
"""Keys per loop iteration of a program in half precision (on an H100, 128 was as fast as 64 or
faster at every batch size measured, up to 1.5x at one row); fp32 takes half as many, the same
bytes: its 128-key tiles need 272 KiB of shared memory, over an H100's or H200's 227."""
NUM_WARPS, NUM_STAGES = 4, 3
"""Triton's launch settings (its defaults)."""


@triton.jit
def _attend(
    q, k_row, v_row, stride_kn, stride_vn, lo, hi, last, scale, dims, in_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The un-normalized output, running max and sum of a tile of query rows `q` over keys
    lo..hi-1, each row reaching the keys up to its `last` ([BLOCK_M]). A row's numbers depend
    only on its own query, its keys and BLOCK_N: the same in a decode step and in the prefill
    kernel below (`attention_rows`), whatever other rows share the tile, and a block of keys
    past a row's last is exactly no change to it (alpha 1, p 0)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, q.shape[1]], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        inside = keys < hi
        tile = inside[:, None] & in_dim[None, :]
        k = tl.load(k_row + keys[:, None] * stride_kn + dims[None, :], mask=tile, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        reach = inside[None, :] & (keys[None, :] <= last[:, None])
        s = tl.where(reach, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_row + keys[:, None] * stride_vn + dims[None, :], mask=tile, other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    scale,
    split_len,
    GROUPS: tl.constexpr,
    REP: tl.constexpr,
    SPLITS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (row, key head, split): the un-normalized output, running max and sum of its REP
    query heads over the split's keys below the row's length."""
    pid, split = tl.program_id(0), tl.program_id(1)
    row, group = pid // GROUPS, pid % GROUPS
    big = row.to(tl.int64)  # a row's offset into a large cache passes 2**31
    position = tl.load(pos_ptr + row).to(tl.int32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, position + 1)
    rows, dims = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    heads = group * REP + rows
    in_dim = dims < DIM
    q = tl.load(
        q_ptr + big * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=(rows < REP)[:, None] & in_dim[None, :],
        other=0.0,
    )
    k_row = k_ptr + big * stride_kb + group.to(tl.int64) * stride_kh
    v_row = v_ptr + big * stride_vb + group.to(tl.int64) * stride_vh
    last = tl.full([BLOCK_M], 0, tl.int32) + position
    acc, m_i, l_i = _attend(
        q, k_row, v_row, stride_kn, stride_vn, lo, hi, last, scale, dims, in_dim,
        BLOCK_M, BLOCK_N, PRECISION,
    )  # fmt: skip
    # partials laid out [b, heads, SPLITS(, DIM)]; one split: the output [b, heads, DIM]
    out_rows = (row * GROUPS * REP + heads) * SPLITS + split
    keep = rows < REP
    out = o_ptr + out_rows[:, None] * DIM + dims[None, :]
    if SPLITS == 1:
        tl.store(out, _normalized(acc, l_i, o_ptr), mask=keep[:, None] & in_dim)
    else:
        tl.store(out, acc, mask=keep[:, None] & in_dim)
        tl.store(m_ptr + out_rows, m_i, mask=keep)
        tl.store(l_ptr + out_rows, l_i, mask=keep)


@triton.jit
def _combine_kernel(
    part_ptr, m_ptr, l_ptr, o_ptr,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (row, query head): its splits' partial outputs, each weighed by exp(its max - the
    largest), over the sums weighed alike; in the output's dtype. One launch where torch's
    reductions and elementwise ops were nine, each a pass over the partials."""
    pid = tl.program_id(0).to(tl.int64)
    splits, dims = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    in_split, in_dim = splits < SPLITS, dims < DIM
    at = pid * SPLITS + splits
    m = tl.load(m_ptr + at, mask=in_split, other=float("-inf"))
    weight = tl.exp(m - tl.max(m, 0))  # an empty split (max -inf) weighs 0; split 0 holds key 0
    total = tl.sum(tl.load(l_ptr + at, mask=in_split, other=0.0) * weight, 0, keep_dims=True)
    part = tl.load(
        part_ptr + at[:, None] * DIM + dims[None, :],
        mask=in_split[:, None] & in_dim[None, :],
        other=0.0,
    )
    acc = tl.sum(part * weight[:, None], 0, keep_dims=True)  # [1, BLOCK_D]: `_normalized`'s tile
    tl.store(
        o_ptr + pid * DIM + dims[None, :], _normalized(acc, total, o_ptr), mask=in_dim[None, :]
    )


@triton.jit
def _normalized(acc, l_i, o_ptr):
    """acc / l in fp32, correctly rounded (torch's division; Triton's `/` is approximate),
    then in the output's dtype: the same bits as dividing after the kernel, without the two
    passes over the output."""
    sums = tl.broadcast_to(l_i[:, None], acc.shape)  # div_rn does not broadcast
    return tl.math.div_rn(acc, sums).to(o_ptr.dtype.element_ty)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, seq,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, scale,
    HEADS: tl.constexpr, REP: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """BLOCK_M consecutive positions of one (row, query head), each over the keys up to it."""
    pid, block = tl.program_id(0), tl.program_id(1)
    row, head = pid // HEADS, pid % HEADS
    big, group = row.to(tl.int64), (head // REP).to(tl.int64)
    rows, dims = block * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    in_dim, keep = dims < DIM, rows < seq
    q = tl.load(
        q_ptr + big * stride_qb + head.to(tl.int64) * stride_qh
        + rows.to(tl.int64)[:, None] * stride_qs + dims[None, :],
        mask=keep[:, None] & in_dim[None, :],
        other=0.0,
    )  # fmt: skip
    k_row = k_ptr + big * stride_kb + group * stride_kh
    v_row = v_ptr + big * stride_vb + group * stride_vh
    hi = tl.minimum((block + 1) * BLOCK_M, seq)
    acc, _, l_i = _attend(
        q, k_row, v_row, stride_kn, stride_vn, 0, hi, rows, scale, dims, in_dim,
        BLOCK_M, BLOCK_N, PRECISION,
    )  # fmt: skip
    out = ((big * HEADS + head) * seq + rows).to(tl.int64)  # [b, heads, seq]
    tl.store(
        o_ptr + out[:, None] * DIM + dims[None, :],
        _normalized(acc, l_i, o_ptr),
        mask=keep[:, None] & in_dim,
    )


def splits_for(rows: int, groups: int, keys: int, device: torch.device) -> int:
    """Splits of a row's keys: enough programs for about four per multiprocessor, each split at
    least 256 keys."""
    programs = rows * groups
    want = -(-4 * multiprocessors(device) // programs)
    return max(1, min(want, keys // 256))


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    one_split: bool = False,
) -> torch.Tensor:
    """q [b, np, hn] (one token per row) against the cache k/v [b, ng, capacity, hn] (last dim
    contiguous), each row reaching its keys 0..positions[row]; query head j reads key head
    j // (np / ng). Cache slots past a row's position are never read. -> [b, np, hn].
    `one_split`: a row's keys in one program, in order — bitwise `attention_rows`' row at that
    position over the same keys."""
    b, heads, dim = q.shape
    groups, capacity = k.shape[1], k.shape[2]
    rep = heads // groups
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    splits = 1 if one_split else splits_for(b, groups, capacity, q.device)
    block_n = _block_n(k)
    split_len = -(-capacity // (splits * block_n)) * block_n
    tiles = _tiles(rep, dim, q.dtype)
    if splits == 1:  # the kernel writes the normalized output (the partials' buffers unused)
        partial = q.new_empty((b, heads, dim))
        maxes = sums = q.new_empty((0,), dtype=torch.float32)
    else:
        partial = q.new_empty((b, heads, splits, dim), dtype=torch.float32)
        maxes = q.new_empty((b, heads, splits), dtype=torch.float32)
        sums = torch.empty_like(maxes)
    _partial_kernel[(b * groups, splits)](
        q,
        k,
        v,
        positions,
        partial,
        maxes,
        sums,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        scale,
        split_len,
        GROUPS=groups,
        REP=rep,
        SPLITS=splits,
        DIM=dim,
        BLOCK_N=block_n,
        **tiles,
    )
    if splits == 1:
        return partial
    out = q.new_empty((b, heads, dim))
    _combine_kernel[(b * heads,)](
        partial, maxes, sums, out,
        SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), DIM=dim, BLOCK_D=tiles["BLOCK_D"],
    )  # fmt: skip
    return out


def _block_n(k: torch.Tensor) -> int:
    return BLOCK_N * 2 // k.element_size()


def _tiles(rep: int, dim: int, dtype: torch.dtype) -> dict[str, object]:
    """The launch settings a row's arithmetic depends on, shared by both kernels: the query tile
    (a key head's query heads in a decode step), the head dim's tile, the dot's precision and
    the warps (which lay the tiles out)."""
    return {
        "BLOCK_M": max(16, triton.next_power_of_2(rep)),
        "BLOCK_D": max(16, triton.next_power_of_2(dim)),
        # fp32 inputs: IEEE products, not TF32 (no effect on bf16/fp16)
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": NUM_WARPS,
        "num_stages": NUM_STAGES,
    }


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [b, np, s, hn] over k/v [b, ng, s, hn] (last dims contiguous),
    query head j reading key head j // (np / ng), computed the way a decode step computes one
    position (`_attend`, the same tiles): row t of the result is bitwise
    `decode_attention(q[:, :, t], k, v, t, one_split=True)` over those keys. A prefill and
    scoring path whose logprobs a decode can reproduce exactly; -> [b, np, s, hn]."""
    b, heads, seq, dim = q.shape
    rep = heads // k.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    tiles = _tiles(rep, dim, q.dtype)
    out = q.new_empty((b, heads, seq, dim))
    if out.numel():
        grid = (b * heads, triton.cdiv(seq, tiles["BLOCK_M"]))
        _prefill_kernel[grid](
            q, k, v, out, seq,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), scale,
            HEADS=heads, REP=rep, DIM=dim, BLOCK_N=_block_n(k), **tiles,
        )  # fmt: skip
    return out
