"""Where a colocated IPC refit's time goes (diagnostic, GPU): the whole refit at several buffer
sizes (per-bucket vs per-refit costs), the trainer's export alone (`send=False`: TP/PP gathers
and layout conversions, no buffers), and the export plus packing into buffers without a receiver;
a refit at the default buffer size with each side's time per phase (the trainer's packing,
waits for acks, sends; the receiver's waits, buffer mapping, staging, commit) through a receiver
process of this script that times `policyworker.refit.ipc` and `Staging`; baseline in the same
run: one on-GPU copy of the same bytes. Prints one JSON line.

    python benchmarks/refit_breakdown.py [--size 7b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from refit_bench import SIZES, copy_seconds
from train_bench import DEVICE, random_model, sync

MiB = 1 << 20


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def timed(fn: Callable[..., Any], key: str, into: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] += time.perf_counter() - t

    return wrapper


def timed_receiver(conn: Any, info: dict, device: str) -> None:
    """A receiver like `GenerationProcess`'s (shared staging, adopted), its phases timed."""
    import policyworker.refit.ipc as ipc
    from policyworker.refit.receiver import Staging

    times: dict[str, float] = collections.defaultdict(float)
    ipc._receive = timed(ipc._receive, "wait_s", times)
    ipc._mapped = timed(ipc._mapped, "map_s", times)
    for name in ("begin", "share", "stage", "verify_in_place", "commit"):
        setattr(Staging, name, timed(getattr(Staging, name), f"{name}_s", times))
    targets = {n: torch.empty(s, dtype=d, device=device) for n, (s, d) in info.items()}
    staging = Staging(info, targets, adopt=True, shared=True)
    conn.send("ready")
    while (address := conn.recv()) is not None:
        times.clear()
        t = time.perf_counter()
        ipc.receive_ipc(staging, address=address, timeout_s=60)
        conn.send({"total_s": time.perf_counter() - t, **times})


def phases(worker: Any, info: dict, device: str, repeats: int) -> dict[str, Any]:
    """The median refit's phases on both sides (default buffer size)."""
    import policyworker.refit.ipc as ipc

    mine: dict[str, float] = collections.defaultdict(float)
    for name in ("_write_direct", "_pack", "_ack", "_post", "_request", "SharedBuffer"):
        setattr(ipc, name, timed(getattr(ipc, name), name.strip("_") + "_s", mine))
    ipc.IpcLink.open = timed(ipc.IpcLink.open, "map_s", mine)
    conn, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=timed_receiver, args=(child, info, device))
    proc.start()
    assert conn.recv() == "ready"
    runs = []
    for _ in range(repeats + 1):
        mine.clear()
        sync()
        t = time.perf_counter()
        conn.send(worker.get_zmq_address())
        worker.stream_weights_via_ipc_zmq()
        theirs = conn.recv()
        runs.append({"total_s": time.perf_counter() - t, "trainer": dict(mine), "receiver": theirs})
    conn.send(None)
    proc.join()
    runs = sorted(runs[1:], key=lambda r: r["total_s"])
    return runs[len(runs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="7b")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from policyworker import MegatronPolicyWorker, PolicyConfig
    from policyworker.generation.process import GenerationProcess
    from policyworker.refit.buffers import SharedBuffer
    from policyworker.refit.export import model_tensors
    from policyworker.refit.layout import Layout, pack

    folder, _, _ = random_model(*SIZES[args.size])
    cfg = PolicyConfig(model_name=str(folder), precision="bfloat16")
    worker = MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
    info = worker.prepare_refit_info()
    src = worker.refit
    nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
    row: dict[str, object] = {"model": args.size, "bytes": nbytes}
    row["export_only_s"] = median_s(
        lambda: worker.stream_weights_via_ipc_zmq(send=False), args.repeats
    )

    def export_and_pack(size: int) -> None:
        layout = Layout(info, size)
        bufs = [SharedBuffer(size, worker.device) for _ in range(2)]
        tensors = model_tensors(src._params(), src.shape, src.groups, info, src._owners, src.device)
        for b in layout.buckets:
            buf = bufs[b.index % 2] if b.nbytes <= size else SharedBuffer(b.nbytes, worker.device)
            pack(b, buf.tensor, tensors)
        for buf in bufs:
            buf.close()

    row["export_pack_2GiB_s"] = median_s(lambda: export_and_pack(2048 * MiB), args.repeats)
    row["buffer_alloc_handle_2x2GiB_s"] = median_s(
        lambda: [SharedBuffer(2048 * MiB, worker.device).handle() for _ in range(2)], args.repeats
    )
    device = f"cuda:{torch.cuda.current_device()}" if DEVICE == "cuda" else "cpu"
    with GenerationProcess(str(folder), info, device=device, load_weights=False) as gen:
        for mib in (256, 1024, 2048, 8192):

            def refit(mib: int = mib) -> None:
                gen.begin_refit_ipc(worker.get_zmq_address())
                worker.stream_weights_via_ipc_zmq(buffer_size_bytes=mib * MiB)
                gen.end_refit()

            row[f"refit_{mib}MiB_s"] = median_s(refit, args.repeats)
    row["phases"] = phases(worker, info, device, args.repeats)
    row["baseline_gpu_copy_s"] = copy_seconds(nbytes, args.repeats)
    row["refit_2048MiB_vs_copy"] = row["baseline_gpu_copy_s"] / row["refit_2048MiB_s"]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
