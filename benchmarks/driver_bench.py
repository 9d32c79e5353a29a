"""The driver's own cost per call: a small batch's round trip through `Policy` (one worker, local
processes or Ray actors) beside the same call on a worker in this process.

* baseline: `MegatronPolicyWorker.get_logprobs` in this process (all its calls first);
* ours:     `Policy.get_logprobs` (one worker in its own process; the batch and the result
            travel by pipe or by Ray), and a call that does nothing (`finalize_async_save`
            with no save pending): the round trip alone.

Prints one JSON line per backend (Ray is skipped where it is not installed).

    python benchmarks/driver_bench.py [--layers 2] [--hidden 256] [--rows 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
from train_bench import DEVICE, emit, random_model, sync


def median_ms(fn: Callable[[], object], calls: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--backends", default="local,ray")
    ap.add_argument("--out", default=None, help="also write the JSON lines here")
    args = ap.parse_args()

    from policyworker import BatchedDataDict, MegatronPolicyWorker, Policy, PolicyConfig

    folder, _, n_params = random_model(args.layers, args.hidden, args.vocab)
    cfg = PolicyConfig(
        model_name=str(folder),
        precision="bfloat16" if DEVICE == "cuda" else "float32",
        logprob_batch_size=args.rows,
        max_total_sequence_length=args.seq,
    )
    g = torch.Generator().manual_seed(0)
    data = BatchedDataDict(
        input_ids=torch.randint(0, args.vocab, (args.rows, args.seq), generator=g),
        input_lengths=torch.full((args.rows,), args.seq),
    )
    # The baseline runs first, alone: the two processes never compete for the cores or the GPU.
    worker = MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
    baseline = median_ms(lambda: worker.get_logprobs(data=data), args.calls)
    local_lp = worker.get_logprobs(data=data)["logprobs"]
    lines = []
    for backend in args.backends.split(","):
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            print("ray is not installed here: skipped")
            continue
        start = time.perf_counter()
        with Policy(
            cfg, num_workers=1, backend=backend, init_optimizer=False, init_reference_model=False
        ) as policy:
            start_s = time.perf_counter() - start
            walls, inside = [], []
            for _ in range(args.calls):  # each call's wall time and its time inside the worker
                walls.append(median_ms(lambda: policy.get_logprobs(data=data), 1, warmup=0))
                inside.append(1e3 * policy.last_call_worker_s)
            ours = statistics.median(walls)
            own = statistics.median(w - i for w, i in zip(walls, inside, strict=True))
            noop = median_ms(policy.finalize_async_save, args.calls)
            same = torch.equal(policy.get_logprobs(data=data)["logprobs"], local_lp)
        # the baseline again, once the group is gone: drift (clocks, caches) shows as a change
        after = median_ms(lambda: worker.get_logprobs(data=data), args.calls)
        row = {
            "bench": "driver",
            "device": DEVICE,
            "backend": backend,
            "params": n_params,
            "batch": [args.rows, args.seq],
            "baseline_in_process_ms": round(baseline, 3),
            "baseline_after_ms": round(after, 3),
            "ours_driver_ms": round(ours, 3),
            "ratio": round(ours / baseline, 3),
            "overhead_ms": round(ours - baseline, 3),
            "inside_worker_ms": round(statistics.median(inside), 3),
            "driver_own_ms": round(own, 3),
            "noop_round_trip_ms": round(noop, 3),
            "start_s": round(start_s, 2),
            "same_logprobs": same,
        }
        emit(row, None)
        lines.append(row)
    if args.out:
        import json
        from pathlib import Path

        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main()
