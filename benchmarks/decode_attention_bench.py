"""A decode step's attention over the KV cache: our Triton kernel against SDPA, one GPU.

The attention of train_bench's ~1.6B model (32 query heads over 8 key/value heads of 64, bf16),
one query token per row against a cache of `keys + 512` slots of which each row has written
`keys`: SDPA under the mask `generation.decode_attention: sdpa` gives it (the baseline) and
`ops.decode_attention` (ours: it reads each row's written keys only, splitting a row's keys
over programs when rows x key heads are too few to fill the GPU). Each is captured in a CUDA
graph of `--calls` calls and replayed, as a decode step runs it; microseconds per call (CUDA
events, the mean over `--repeats` replays), the rate ours reads the written keys and values at,
its splits and its largest difference from SDPA.

    python benchmarks/decode_attention_bench.py [--cases 256x1024,64x1024,8x8192,1x32768]

`--smoke`: a tiny fp32 run on the CPU, our kernel in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:  # Triton reads it when a kernel is defined: before policyworker's
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    import interpreter  # noqa: F401  (the interpreter's loop bounds read from memory)

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import DEVICE, emit

from policyworker.model.attention.cached import sdpa_decode
from policyworker.ops.decode_attention import decode_attention, splits_for

HEADS, GROUPS, DIM, SPARE = 32, 8, 64, 512


def per_call_us(fn: Callable[[], torch.Tensor], calls: int, repeats: int) -> float:
    """Microseconds per call of `fn`: `calls` calls captured in one CUDA graph, replayed
    `repeats` times (on the CPU: plain calls)."""
    if DEVICE != "cuda":
        import time

        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / (repeats * calls)


def case(batch: int, keys: int, dtype: torch.dtype, calls: int, repeats: int) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(batch * keys)
    capacity = keys + SPARE
    q = torch.randn(batch, HEADS, DIM, generator=g, device=DEVICE, dtype=dtype)
    k, v = (
        torch.randn(batch, GROUPS, capacity, DIM, generator=g, device=DEVICE, dtype=dtype)
        for _ in range(2)
    )
    positions = torch.full((batch,), keys - 1, device=DEVICE)
    scale = DIM**-0.5
    ours = per_call_us(lambda: decode_attention(q, k, v, positions, scale), calls, repeats)
    sdpa = per_call_us(
        lambda: sdpa_decode(q[:, :, None], k, v, positions[None, :], scale), calls, repeats
    )
    err = (
        decode_attention(q, k, v, positions, scale).float()
        - sdpa_decode(q[:, :, None], k, v, positions[None, :], scale)[:, :, 0].float()
    )
    read = 2 * batch * GROUPS * keys * DIM * k.element_size()  # the written keys and values
    return {
        "sdpa_us": sdpa,
        "ours_us": ours,
        "ours_vs_sdpa": sdpa / ours,
        "ours_tb_per_s": read / ours / 1e6,
        "splits": splits_for(batch, GROUPS, capacity, q.device),
        "max_abs_diff": err.abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="256x1024,64x1024,8x8192,1x32768", help="rowsxkeys")
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a tiny fp32 run (CPU)")
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()
    if args.smoke:
        args.cases, args.repeats = "2x64,1x600", 1
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    row: dict[str, object] = {"bench": "decode_attention", "device": DEVICE, "dtype": str(dtype)}
    for spec in args.cases.split(","):
        batch, keys = (int(x) for x in spec.split("x"))
        row[spec] = case(batch, keys, dtype, args.calls, args.repeats)
        print(spec, row[spec], file=sys.stderr)
    emit(row, args.out)


if __name__ == "__main__":
    main()
