"""Every benchmark in turn, each in its own process under a time budget, into one JSONL: one
short GPU run measures the set.

Each benchmark runs as `python benchmarks/NAME.py ARGS --out FILE` with its own temporary
folder (TMPDIR) under `--root`: whatever it writes there (model folders of 3-21 GB,
checkpoints) is removed when it ends — finished, failed, out of time (its process group is
killed) or interrupted — unless `--keep`. One JSON line per benchmark:

    {"bench": NAME, "status": "ok" | "failed" | "timeout", "seconds": ..., "argv": [...],
     "result": <its own JSON line(s)> | null, "stderr_tail": "..." (not ok)}

    python benchmarks/run_all.py --out runs/bench.jsonl [--only hybrid,moe] [--budget 300]
    python benchmarks/run_all.py --smoke --out /tmp/smoke.jsonl     # each one's CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent

# name -> (script, GPU arguments (an 80 GB card), CPU smoke arguments)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "train": ("train_bench.py", ["--steps", "5"],
              ["--layers", "2", "--hidden", "64", "--vocab", "128", "--seq", "32", "--batch", "2",
               "--steps", "1"]),
    "moe": ("moe_bench.py", ["--layers", "6", "--steps", "4"],
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim",
             "16", "--experts", "8", "--topk", "2", "--expert-ffn", "32", "--vocab", "128",
             "--seq", "32", "--batch", "2", "--steps", "1"]),
    "hybrid": ("hybrid_bench.py", ["--steps", "3"],
               ["--layers", "4", "--hidden", "64", "--ffn", "96", "--vocab", "128", "--lengths",
                "64", "--long", "128", "--kernel-tokens", "128", "--steps", "1", "--small"]),
    "generation": ("generation_bench.py", ["--batches", "256", "--new", "256",
                                           "--engines", "ours,engine"], ["--smoke"]),
    "refit": ("refit_bench.py", ["--sizes", "1.6b"], ["--sizes", "tiny", "--repeats", "1"]),
    "sparse_refit": ("sparse_refit_bench.py", ["--sizes", "1b", "--lrs", "1e-6"],
                     ["--sizes", "tiny", "--lrs", "1e-6", "--steps", "1"]),
    "ckpt": ("ckpt_bench.py", [], ["--layers", "2", "--hidden", "64", "--vocab", "128"]),
}  # fmt: skip


def run_one(name: str, argv: list[str], budget: float, root: Path, keep: bool) -> dict:
    """One benchmark in its own session and temporary folder; its record."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    out = tmp / "result.jsonl"
    cmd = [sys.executable, str(HERE / BENCHMARKS[name][0]), *argv, "--out", str(out)]
    env = os.environ | {"TMPDIR": str(tmp)}
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: a timeout kills its children too
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=budget)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        status = "timeout"
    except BaseException:  # interrupted: nothing of it stays behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    lines = out.read_text().splitlines() if out.exists() else []
    results = [json.loads(line) for line in lines if line.strip()]
    record = {
        "bench": name,
        "status": status,
        "seconds": round(time.monotonic() - start, 1),
        "argv": argv,
        "result": results[0] if len(results) == 1 else results or None,
    }
    if status != "ok":
        record["stderr_tail"] = (err or "")[-2000:]
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def main(args: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSONL to write (one line per benchmark)")
    ap.add_argument("--only", default="", help=f"comma-separated, of {', '.join(BENCHMARKS)}")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per benchmark")
    ap.add_argument("--smoke", action="store_true", help="each benchmark's CPU smoke arguments")
    ap.add_argument("--root", default=None, help="where the temporary folders go")
    ap.add_argument("--keep", action="store_true", help="keep each benchmark's folder")
    a = ap.parse_args(args)
    names = [n for n in a.only.split(",") if n] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        ap.error(f"--only: unknown {unknown}; known: {', '.join(BENCHMARKS)}")
    root = Path(a.root or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    records = []
    with open(a.out, "w") as f:
        for name in names:
            _, gpu, smoke = BENCHMARKS[name]
            record = run_one(name, smoke if a.smoke else gpu, a.budget, root, a.keep)
            f.write(json.dumps(record) + "\n")
            f.flush()
            print(f"{name}: {record['status']} in {record['seconds']} s", file=sys.stderr)
            records.append(record)
    return records


if __name__ == "__main__":
    main()
