"""Distributed checkpoints on the ~1.6B model of train_bench.py (bf16, Adam state).

In one process, on one GPU:

* baseline: one device tensor of the bytes a checkpoint stages, copied into an exact-size pinned
            host buffer (`copy_(non_blocking=True)` + synchronize) — the device-to-host floor;
* async:    `save_checkpoint(weights, optim, async_save=True)`: the time until it returns (what
            the training loop waits for), then `finalize_async_save()` (write + commit);
* sync:     `save_checkpoint(..., async_save=False)`, with and without the SHA-256 integrity
            record (`checkpoint.verify_integrity`);
* load:     `load_checkpoint(weights, optim)` with the files in the page cache and after evicting
            them (`posix_fadvise(DONTNEED)` once they are synced to disk).

Saves land in the page cache; `fsync_s` is the time to then make every file durable. Prints one
JSON line. Needs a GPU (runs on CPU as a smoke test with a small model).

    python benchmarks/ckpt_bench.py [--layers 22] [--hidden 2048] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch
from memory_bench import raw_copy_seconds, seconds, trained_worker
from train_bench import DEVICE, emit, free, temporary_folder

GB = 1e9


def on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def fsync_tree(folder: Path) -> float:
    t = time.perf_counter()
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t


def evict(folder: Path) -> None:
    """Drop the (synced) files from the page cache, so the next read comes from the disk."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def checksum(worker) -> float:
    return float(sum(p.detach().double().sum() for p in worker.state.model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()

    from policyworker import NLLLoss

    root = temporary_folder("ckpt-bench-", args.dir)  # removed at exit, on failure too
    worker, data, folder, n_params = trained_worker(args.layers, args.hidden, args.vocab)

    def save(name: str, *, async_save: bool, verify: bool = True) -> dict[str, float]:
        worker.checkpoints.verify_integrity = verify
        w, o = root / name / "weights", root / name / "optim"
        blocking = seconds(lambda: worker.save_checkpoint(w, o, async_save=async_save))
        timing = worker.checkpoints.last_save_timing
        row = {"blocking_s": blocking} | {k: v for k, v in timing.items() if k.endswith("_s")}
        if async_save:
            row["finalize_s"] = seconds(worker.finalize_async_save)
        row["bytes_on_disk"] = on_disk(root / name)
        row["fsync_s"] = fsync_tree(root / name)
        return row

    first_async = save("a0", async_save=True)  # allocates and page-locks the staging memory
    staged = int(worker.checkpoints.last_save_timing["staged_bytes"])
    shutil.rmtree(root / "a0")
    free()
    raw_d2h, _, raw_pinned = raw_copy_seconds(staged)
    free()
    async_row = save("a1", async_save=True)
    shutil.rmtree(root / "a1")
    sync_noverify = save("s1", async_save=False, verify=False)
    shutil.rmtree(root / "s1")
    sync_row = save("s0", async_save=False)  # kept for the loads (integrity checked, the default)
    before = checksum(worker)
    worker.train(data, NLLLoss())  # move the weights away from the checkpoint
    w, o = root / "s0" / "weights", root / "s0" / "optim"
    load_warm = seconds(lambda: worker.load_checkpoint(w, o))
    evict(root / "s0")
    load_cold = seconds(lambda: worker.load_checkpoint(w, o))
    restored = checksum(worker) == before
    written = sync_row["bytes_on_disk"]
    shutil.rmtree(root)
    shutil.rmtree(folder)

    def total(row: dict[str, float]) -> float:
        return row["blocking_s"] + row.get("finalize_s", 0.0)

    emit(
        {
            "bench": "checkpoint",
            "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "params": n_params,
            "staged_bytes": staged,
            "bytes_on_disk": written,
            "raw_pinned_d2h_s": raw_d2h,
            "raw_pinned_d2h_gbps": staged / raw_d2h / GB,
            "raw_host_buffer_pinned": raw_pinned,
            "async_first": first_async,
            "async": async_row,
            "async_blocking_over_raw_d2h": async_row["blocking_s"] / raw_d2h,
            "sync": sync_row,
            "sync_no_integrity": sync_noverify,
            "integrity_cost_s": total(sync_row) - total(sync_noverify),
            "async_total_over_sync": total(async_row) / total(sync_row),
            "write_gbps_page_cache": written / total(sync_noverify) / GB,
            "write_gbps_durable": written / (total(sync_noverify) + sync_noverify["fsync_s"]) / GB,
            "load_warm_s": load_warm,
            "load_cold_s": load_cold,
            "load_warm_gbps": written / load_warm / GB,
            "load_cold_gbps": written / load_cold / GB,
            "load_restores_weights": restored,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
