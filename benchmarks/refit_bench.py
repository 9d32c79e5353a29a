"""Colocated IPC refit: a trainer streams its weights to a generation process on the same GPU.

* ours:     `begin_refit_ipc` + `stream_weights_via_ipc_zmq` + `end_refit` (the receiver has
            staged, verified and applied every tensor), with and without the bucket checksum,
            into the engine's shared staging (the default) and through the trainer's buffers;
* baseline: one on-GPU copy of the same bytes (`dst.copy_(src)`), in the same run.

Also the trainer's extra peak memory during a refit. Prints one JSON line per model size.

    python benchmarks/refit_bench.py [--sizes 1.6b,7b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from train_bench import DEVICE, emit, free, random_model, sync

SIZES = {  # layers, hidden, vocab (intermediate 4 x hidden, GQA 32/8 heads; see train_bench)
    "1.6b": (22, 2048, 128256),
    "7b": (30, 4096, 128256),
    "tiny": (2, 256, 1000),  # a CPU smoke run of the script
}
GB = 1e9


def log(what: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def copy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def refit_seconds(worker, gen, repeats: int, checksum: bool) -> tuple[float, int, list[int]]:
    """Median seconds of a whole refit, the trainer's extra peak bytes, the versions applied."""
    worker.refit.weights.cfg.checksum = checksum
    times, versions, peak = [], [], 0
    for _ in range(repeats + 1):  # the first one maps the buffers and warms up
        sync()
        base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        gen.begin_refit_ipc(worker.get_zmq_address())
        worker.stream_weights_via_ipc_zmq()
        versions.append(gen.end_refit())
        times.append(time.perf_counter() - t)
        if DEVICE == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return statistics.median(times[1:]), peak, versions


def bench(size: str, repeats: int) -> dict[str, object]:
    from policyworker import MegatronPolicyWorker, PolicyConfig
    from policyworker.generation.process import GenerationProcess, tensor_sums

    layers, hidden, vocab = SIZES[size]
    t0 = time.perf_counter()
    folder, _, n_params = random_model(layers, hidden, vocab)
    log(f"{size}: model saved", t0)
    cfg = PolicyConfig(model_name=str(folder), precision="bfloat16")
    worker = MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
    info = worker.prepare_refit_info()
    log(f"{size}: worker loaded", t0)
    nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
    device = f"cuda:{torch.cuda.current_device()}" if DEVICE == "cuda" else "cpu"
    with GenerationProcess(str(folder), info, device=device, load_weights=False) as gen:
        log(f"{size}: generation process up", t0)
        with_sum, peak, versions = refit_seconds(worker, gen, repeats, checksum=True)
        log(f"{size}: refits done", t0)
        without_sum, _, more = refit_seconds(worker, gen, repeats, checksum=False)
        sums = gen.weight_sums()
        exact = all(sums[n] == tensor_sums(t) for n, t in worker.export_hf_weights())
    free()
    with GenerationProcess(
        str(folder), info, device=device, load_weights=False, shared_staging=False
    ) as gen:
        buffered, buffered_peak, _ = refit_seconds(worker, gen, repeats, checksum=False)
        sums = gen.weight_sums()
        exact = exact and all(sums[n] == tensor_sums(t) for n, t in worker.export_hf_weights())
        log(f"{size}: buffered refits done", t0)
    copy = copy_seconds(nbytes, repeats)
    free()
    return {
        "bench": "refit_ipc",
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "model": size,
        "params": n_params,
        "bytes": nbytes,
        "tensors": len(info),
        "buffer_bytes": worker.refit.weights.bucket_bytes(None),
        "ours_s": with_sum,
        "ours_gbps": nbytes / with_sum / GB,
        "ours_no_checksum_s": without_sum,
        "checksum_cost": with_sum / without_sum - 1,
        "gpu_copy_s": copy,
        "gpu_copy_gbps": nbytes / copy / GB,
        "ours_vs_copy": copy / with_sum,
        "ours_no_checksum_vs_copy": copy / without_sum,
        "trainer_extra_peak_bytes": peak,
        "buffered_no_checksum_s": buffered,
        "buffered_no_checksum_vs_copy": copy / buffered,
        "buffered_trainer_extra_peak_bytes": buffered_peak,
        "versions": versions + more,
        "receiver_weights_exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1.6b,7b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the JSON lines here")
    args = parser.parse_args()
    lines = []
    for size in args.sizes.split(","):
        row = bench(size, args.repeats)
        emit(row, None)  # each size as soon as it is measured
        lines.append(json.dumps(row) + "\n")
        if args.out:
            Path(args.out).write_text("".join(lines))


if __name__ == "__main__":
    main()
