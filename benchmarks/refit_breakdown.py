"""Where a colocated IPC refit's time goes (diagnostic, GPU): the whole refit at several buffer
sizes (per-bucket vs per-refit costs), the trainer's export alone (`send=False`: TP/PP gathers
and layout conversions, no buffers), and the export plus packing into buffers without a receiver;
baseline in the same run: one on-GPU copy of the same bytes. Prints one JSON line.

    python benchmarks/refit_breakdown.py [--size 7b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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
    row["baseline_gpu_copy_s"] = copy_seconds(nbytes, args.repeats)
    row["refit_2048MiB_vs_copy"] = row["baseline_gpu_copy_s"] / row["refit_2048MiB_s"]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
