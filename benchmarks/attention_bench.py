"""Attention of one long packed row, forward + backward, one GPU: the flash varlen kernel every
packed bin takes (the baseline) against causal SDPA, plain and as a bin that one row fills runs
it (`sdpa_bucketed`: the worker's own `_one_sequence`), warm and on a sequence length it has not
seen.

SDPA's default on Hopper is cuDNN's attention, faster per call than flash, but cuDNN builds a
graph for each new shape; RL rows all differ in length, so the first call at a new length is
what a training step pays. `--avoid-recompile` sets `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`
(PyTorch's opt-in to cuDNN's variable-length path) before anything runs; `sdpa_bucketed` pads
the row to a multiple of 1024 tokens, so that lengths share graphs (the three new lengths fall in
one bucket: only the first builds). The attention of
train_bench's ~1.6B model: 32 query heads over 8 key/value heads of 64, bf16, `[tokens, heads,
64]` as megatron hands them over.

    python benchmarks/attention_bench.py [--lengths 16384,32768] [--repeats 5] [--avoid-recompile]

Per length: milliseconds per call when warm (CUDA events, mean of `--repeats`), and the mean
first call at three new lengths (length + 128·i, i = 1..3; wall time, synchronized) minus the
warm call: the per-length cost.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import emit, event_ms

HEADS, KV_HEADS, DIM = 32, 8, 64
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def one_row_pack(t: int) -> tuple[torch.Tensor, object]:
    """(cu_seqlens, PackedSeqParams) of a bin that one row of t tokens fills, made once per
    length: a packed step makes them once per micro-batch, not per layer, so not inside the
    timed calls either."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    return cu, PackedSeqParams(qkv_format="thd", max_seqlen_q=t, max_seqlen_kv=t)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from policyworker.model.attention.kernels import varlen_cuda

    cu, params = one_row_pack(q.shape[0])
    return varlen_cuda(q, k, v, cu, cu, params, DIM**-0.5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The one row as [1, heads, tokens, dim] views, causal, torch's choice of kernel."""
    from policyworker.model.attention.kernels import causal_sdpa

    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    return causal_sdpa(q4, k4, v4, DIM**-0.5)[0].transpose(0, 1)


def sdpa_bucketed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What a bin that one row fills runs (`model.attention.kernels.one_sequence`): `sdpa` on the row
    padded at its end to its bucket (a multiple of 1024 tokens at these lengths), so that
    lengths share cuDNN graphs; the padding's output is dropped."""
    from policyworker.model.attention.kernels import one_sequence

    return one_sequence(q, k, v, DIM**-0.5)


def inputs(length: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(length)
    return [
        torch.randn(
            length, h, DIM, generator=g, device="cuda", dtype=torch.bfloat16
        ).requires_grad_()
        for h in (HEADS, KV_HEADS, KV_HEADS)
    ]


def warm_ms(kernel: Kernel, x: list[torch.Tensor], repeats: int, backward: bool) -> float:
    def call() -> None:
        out = kernel(*x)
        if backward:
            out.sum().backward()

    return event_ms(call, repeats)


def first_call_ms(kernel: Kernel, length: int) -> float:
    """Forward + backward at lengths not seen before, the first call each (wall time)."""
    times = []
    for i in (1, 2, 3):
        x = inputs(length + 128 * i)
        torch.cuda.synchronize()
        t = time.perf_counter()
        kernel(*x).sum().backward()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sum(times) / len(times)


def row(length: int, repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, kernel in (("varlen", varlen), ("sdpa", sdpa), ("sdpa_bucketed", sdpa_bucketed)):
        x = inputs(length)
        out[f"{name}_fwd_ms"] = warm_ms(kernel, x, repeats, backward=False)
        out[f"{name}_fwd_bwd_ms"] = warm_ms(kernel, x, repeats, backward=True)
        first = first_call_ms(kernel, length)
        out[f"{name}_new_length_extra_ms"] = first - out[f"{name}_fwd_bwd_ms"]
    out["sdpa_speedup_warm"] = out["varlen_fwd_bwd_ms"] / out["sdpa_fwd_bwd_ms"]
    out["sdpa_bucketed_speedup_warm"] = out["varlen_fwd_bwd_ms"] / out["sdpa_bucketed_fwd_bwd_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--lengths", type=ints, default=[16384, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--avoid-recompile", action="store_true")
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_bench measures GPU kernels: it needs CUDA")
    if args.avoid_recompile:
        os.environ["TORCH_CUDNN_SDPA_AVOID_RECOMPILE"] = "1"
    rows = {str(n): row(n, args.repeats) for n in args.lengths}
    emit(
        {
            "bench": "attention_one_row",
            "device": torch.cuda.get_device_name(),
            "avoid_recompile": args.avoid_recompile,
            **rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
