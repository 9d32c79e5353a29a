"""Memory phases on the ~1.6B model of train_bench.py (bf16, Adam state): what an offload leaves
on the GPU, offload/onload bandwidth beside a raw pinned copy of the same bytes in the same run,
the time of a whole colocated cycle, and the memory after 20 cycles.

* ours:     `offload_before_refit()` + `offload_after_refit()` (params, fp32 masters and Adam's
            moments copied to the host, gradients freed), then `prepare_for_lp_inference()` +
            `prepare_for_training()` (all of it back, gradients zero-filled);
* baseline: one device tensor of the bytes ours copies, copied to an exact-size pinned host
            buffer and back (`copy_(non_blocking=True)` + synchronize).

Prints one JSON line. Needs a GPU for meaningful figures (runs on CPU as a smoke test).

    python benchmarks/memory_bench.py [--layers 22] [--hidden 2048] [--cycles 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from train_bench import DEVICE, emit, free, full_rows, random_model, sync

GB = 1e9


def seconds(fn: Callable[[], object]) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def raw_copy_seconds(nbytes: int, repeats: int = 5) -> tuple[float, float, bool]:
    """Median seconds of a device -> pinned host copy and back, of `nbytes` in one tensor, and
    whether the host buffer was pinned."""
    from policyworker.memory.host import HostArena

    arena = HostArena([nbytes], pin=DEVICE == "cuda")
    host = arena.slot(0)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    d2h = [seconds(lambda: host.copy_(dev, non_blocking=True)) for _ in range(repeats)]
    h2d = [seconds(lambda: dev.copy_(host, non_blocking=True)) for _ in range(repeats)]
    return statistics.median(d2h), statistics.median(h2d), arena.pinned


def pin_seconds(nbytes: int) -> dict[str, float]:
    """Seconds to allocate and page-lock a host arena, with and without faulting pages in first."""
    from policyworker.memory.host import HostArena

    out = {}
    for prefault in (False, True):
        t = time.perf_counter()
        arena = HostArena([nbytes], pin=DEVICE == "cuda", prefault=prefault)
        out[f"prefault_{prefault}"] = time.perf_counter() - t
        del arena
    return out


def device_figures(worker) -> dict[str, int]:
    s = worker.memory_stats()
    keys = ("allocated_bytes", "reserved_bytes", "device_used_bytes", "host_buffer_bytes")
    return {k: int(s[k]) for k in keys} | {"process_rss_bytes": _rss()}


def _rss() -> int:
    from policyworker.memory.telemetry import _resident_bytes

    return _resident_bytes() if DEVICE == "cuda" else 0


def trained_worker(layers: int, hidden: int, vocab: int):
    """A bf16 worker on a random model after one NLL step (so Adam state exists), with its batch:
    (worker, batch, model folder, parameter count)."""
    from policyworker import MegatronPolicyWorker, NLLLoss, PolicyConfig

    folder, cfg, n_params = random_model(layers, hidden, vocab)
    b, s = 2, 512
    worker = MegatronPolicyWorker(
        PolicyConfig(
            model_name=str(folder),
            precision="bfloat16",
            train_global_batch_size=b,
            train_micro_batch_size=b,
            logprob_batch_size=b,
            max_total_sequence_length=s,
        ),
        init_reference_model=False,
    )
    data = full_rows(torch.randint(0, cfg.vocab_size, (b, s)))
    worker.train(data, NLLLoss())
    free()
    return worker, data, folder, n_params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()

    from policyworker import NLLLoss

    worker, data, _, n_params = trained_worker(args.layers, args.hidden, args.vocab)
    training = device_figures(worker)
    placed = worker.memory.bytes_by_place()
    state_bytes = sum(placed.values())
    groups = worker.memory._groups
    moved = groups["params"].nbytes + groups["optimizer"].nbytes  # copied; grads are freed

    # The baseline first, while no arena of ours is pinned (page-locked memory may be capped).
    raw_d2h, raw_h2d, raw_pinned = raw_copy_seconds(moved)
    free()
    first_off = seconds(lambda: (worker.offload_before_refit(), worker.offload_after_refit()))
    offloaded = device_figures(worker)
    first_on = seconds(lambda: (worker.prepare_for_lp_inference(), worker.prepare_for_training()))
    after_first = device_figures(worker)
    offs, ons = [], []
    for _ in range(args.cycles):
        offs.append(seconds(lambda: (worker.offload_before_refit(), worker.offload_after_refit())))
        ons.append(
            seconds(lambda: (worker.prepare_for_lp_inference(), worker.prepare_for_training()))
        )
    after_cycles = device_figures(worker)
    loss_after = worker.train(data, NLLLoss())["loss"]  # still trains
    off_s, on_s = statistics.median(offs), statistics.median(ons)

    row = {
        "bench": "memory_phases",
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "params": n_params,
        "training_state_bytes": state_bytes,
        "copied_bytes": moved,
        "training": training,
        "after_offload": offloaded,
        "left_on_gpu_fraction_allocated": offloaded["allocated_bytes"] / state_bytes,
        "left_on_gpu_fraction_reserved": offloaded["reserved_bytes"] / state_bytes,
        "first_offload_s": first_off,
        "first_onload_s": first_on,
        "ours_offload_s": off_s,
        "ours_onload_s": on_s,
        "ours_cycle_s": off_s + on_s,
        "ours_offload_gbps": moved / off_s / GB,
        "ours_onload_gbps": moved / on_s / GB,
        "raw_host_buffer_pinned": raw_pinned,
        "ours_host_buffers_pinned": all(
            g.arena.pinned for g in groups.values() if g.arena is not None
        ),
        "raw_pinned_d2h_gbps": moved / raw_d2h / GB,
        "raw_pinned_h2d_gbps": moved / raw_h2d / GB,
        "offload_ratio": raw_d2h / off_s,
        "onload_ratio": raw_h2d / on_s,
        "after_first_cycle": after_first,
        f"after_{args.cycles}_cycles": after_cycles,
        "loss_after_cycles": loss_after,
        "pin_seconds_4gb": pin_seconds(4 * 10**9),
    }
    emit(row, args.out)


if __name__ == "__main__":
    main()
