"""Attention of one packed sequence (a bin that one row fills), forward + backward, one GPU.

The baseline is the flash varlen kernel every packed bin took before (`_varlen_cuda`); ours is
what such a bin takes now (`_one_sequence`: plain causal SDPA, whose kernel torch picks — cuDNN
on Hopper). For reference, SDPA pinned to each of its backends. The attention of train_bench's
~1.6B model: 32 query heads over 8 key/value heads of 64, bf16, `[tokens, heads, 64]` as
megatron hands them over. Milliseconds per call (CUDA events, mean of `--repeats`).

    python benchmarks/attention_bench.py [--lengths 16384,32768] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import emit

HEADS, KV_HEADS, DIM = 32, 8, 64
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def milliseconds(call: Callable[[], None], repeats: int) -> float:
    for _ in range(2):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def row(length: int, repeats: int) -> dict[str, object]:
    from megatron.core.packed_seq_params import PackedSeqParams

    from policyworker.model.attention import _one_sequence, _varlen_cuda

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(length, h, DIM, generator=g, device="cuda", dtype=torch.bfloat16)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", max_seqlen_q=length, max_seqlen_kv=length)
    scale = DIM**-0.5
    kernels: dict[str, Callable[[], torch.Tensor]] = {
        "varlen": lambda: _varlen_cuda(q, k, v, cu, cu, params, scale),
        "ours": lambda: _one_sequence(q, k, v, scale),
    }
    out: dict[str, object] = {}
    for name, kernel in kernels.items():
        out[f"{name}_fwd_ms"] = milliseconds(lambda f=kernel: f(), repeats)
        out[f"{name}_fwd_bwd_ms"] = milliseconds(lambda f=kernel: f().sum().backward(), repeats)
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                out[f"sdpa_{name}_fwd_bwd_ms"] = milliseconds(
                    lambda: _one_sequence(q, k, v, scale).sum().backward(), repeats
                )
        except RuntimeError as error:  # a backend that takes no grouped heads, or this shape
            out[f"sdpa_{name}_fwd_bwd_ms"] = f"unavailable: {str(error)[:80]}"
    out["speedup_fwd_bwd"] = out["varlen_fwd_bwd_ms"] / out["ours_fwd_bwd_ms"]  # type: ignore[operator]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--lengths", type=ints, default=[16384, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_bench measures GPU kernels: it needs CUDA")
    rows = {str(n): row(n, args.repeats) for n in args.lengths}
    emit(
        {"bench": "attention_one_sequence", "device": torch.cuda.get_device_name(), **rows},
        args.out,
    )


if __name__ == "__main__":
    main()
