"""Where a scoring call's memory goes, counted on the CPU as a GPU would allocate it.

`get_logprobs` of one sequence (packed), by a worker without `logprob_chunk_size` (the
baseline) and one with it (ours), under a `TorchDispatchMode` that counts every tensor of at least
1 MiB while it is alive (a finalizer per storage) and keeps the list of those alive at the peak.
What runs as one compiled kernel on a GPU (`ops.compiled.cuda_compiled`: the norms, RoPE, the
logit passes) and the attention (flash there, SDPA with its scores here) count their outputs
only, not the eager temporaries the CPU makes. Peaks are given in units of one [tokens, hidden]
bf16 tensor, and in GiB scaled to `--scale-to` tokens: a layer's tensors grow with the tokens, so
a short sequence through two layers shows a long one's peak when the chunk and RoPE's rows per
pass shrink alike (defaults: 8k tokens for 128k, 16x fewer; chunks of 256 for 4096; RoPE's 256
rows for 4096). Prints one JSON line: both peaks, their ratio, the largest tensors alive at each.

    python benchmarks/scoring_memory.py [--length 8192] [--chunk 256] [--in-place-rows 256]
        [--layers 2] [--hidden 2048] [--vocab 128256] [--scale-to 131072]
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback
import types
import weakref
from typing import Any

import torch
from long_context_bench import worker_for
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from train_bench import emit, full_rows, random_model


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors (≥ 1 MiB) alive, their peak and what was alive at it."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        """Count from zero."""
        self.live: dict[int, tuple[int, str]] = {}
        self.now = self.peak = 0
        self.at_peak: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.count(out, func.__name__)
        return out

    def count(self, out: object, what: str) -> None:
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or storage.nbytes() < 2**20:
                continue
            self.live[key] = (storage.nbytes(), f"{what} {tuple(t.shape)} {where()}")
            self.now += storage.nbytes()
            weakref.finalize(storage, self.free, key)
            if self.now > self.peak:
                self.peak, self.at_peak = self.now, list(self.live.values())

    def free(self, key: int) -> None:
        if key in self.live:
            self.now -= self.live.pop(key)[0]


def where() -> str:
    """The innermost frames of ours or megatron's that made a tensor."""
    frames = [
        f
        for f in traceback.extract_stack()
        if "policyworker" in f.filename or "megatron" in f.filename
    ]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in frames[::-1][:3])


def as_one_kernel(fn: Any, probe: LiveBytes) -> Any:
    """`fn`, its temporaries uncounted: only what it returns is allocated."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            out = fn(*args, **kwargs)
        probe.count(out, fn.__name__)
        return out

    return run


def fused_like_a_gpu(probe: LiveBytes) -> None:
    """Every `cuda_compiled` function of ours imported so far, and the CPU attention, as one
    kernel (again: what is already patched stays as it is)."""
    from policyworker.model import attention
    from policyworker.ops import compiled

    dispatch_code = compiled.cuda_compiled(lambda x: x).__code__
    for name, module in list(sys.modules.items()):
        if not name.startswith("policyworker.") or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            if getattr(value, "__code__", None) is dispatch_code:
                setattr(module, attr, as_one_kernel(value, probe))
    if not hasattr(attention._varlen_reference, "__wrapped__"):
        attention._varlen_reference = as_one_kernel(attention._varlen_reference, probe)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=256, help="logprob_chunk_size")
    parser.add_argument("--in-place-rows", type=int, default=256, help="RoPE's rows per pass")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--scale-to", type=int, default=131072)
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()
    from policyworker.model import attention

    attention.IN_PLACE_ROWS = args.in_place_rows
    folder, cfg, _ = random_model(args.layers, args.hidden, args.vocab)
    data = full_rows(torch.randint(0, cfg.vocab_size, (1, args.length)))
    unit = args.length * args.hidden * 2
    row: dict[str, Any] = {"bench": "scoring_memory", **vars(args), "unit_bytes": unit}
    probe = LiveBytes()
    for name, chunk in (("unchunked", None), ("chunked", args.chunk)):
        worker = worker_for(folder, args.length, None, chunk, train=False)
        fused_like_a_gpu(probe)  # the worker has imported every module it runs
        probe.reset()
        with probe:
            worker.get_logprobs(data=data)
        worker.shutdown()
        scale = args.scale_to / args.length
        row[name] = {
            "peak_units": probe.peak / unit,
            "peak_gib_scaled": probe.peak * scale / 2**30,
            "at_peak": [
                f"{size / unit:.2f} {what}" for size, what in sorted(probe.at_peak, reverse=True)
            ][:12],
        }
        print(f"{name}: peak {probe.peak / unit:.2f} units", file=sys.stderr, flush=True)
    row["ratio"] = row["chunked"]["peak_units"] / row["unchunked"]["peak_units"]
    emit(row, args.out)


if __name__ == "__main__":
    main()
