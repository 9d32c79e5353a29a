"""Start-up and shut-down costs, beside the floor they stand on.

* baseline: fresh interpreters importing torch alone, torch + transformers, torch + megatron-core
  (what any process of this stack pays);
* ours:     fresh interpreters importing `policyworker.driver.policy` (a driver) and
            `policyworker.worker` then building a worker's stack; in this process, a one-worker
            `Policy` on a tiny random model: its start, first and second `get_logprobs`,
            `shutdown`; and the whole `python -m policyworker refit-check` (IPC) as a user runs it.

Each interpreter figure is the median of `--repeats` runs. Prints one JSON line.

    python benchmarks/startup_bench.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER_STACK = "import policyworker.worker, policyworker.assembly"  # what a worker process loads


def interpreter_s(code: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def tiny_model(folder: Path) -> Path:
    from policyworker.demo.grpo import tiny_llama
    from policyworker.demo.task import char_tokenizer

    tokenizer = char_tokenizer()
    model = tiny_llama(folder, len(tokenizer), seed=0)
    tokenizer.save_pretrained(model)
    return model


def policy_timings(model: Path) -> dict[str, float]:
    import torch

    from policyworker import BatchedDataDict, Policy, PolicyConfig

    cfg = PolicyConfig(model_name=str(model), precision="float32", max_total_sequence_length=32)
    ids = torch.randint(0, 10, (4, 16))
    batch = BatchedDataDict(input_ids=ids, input_lengths=torch.full((4,), 16))
    out = {}
    start = time.perf_counter()
    policy = Policy(cfg, num_workers=1)
    out["policy_start_s"] = time.perf_counter() - start
    for name in ("first_call_s", "second_call_s"):
        start = time.perf_counter()
        policy.get_logprobs(batch)
        out[name] = time.perf_counter() - start
    start = time.perf_counter()
    policy.shutdown()
    out["shutdown_s"] = time.perf_counter() - start
    return {k: round(v, 3) for k, v in out.items()}


def refit_check(model: Path) -> tuple[float, bool]:
    """The command's seconds, and whether it passed (its output is shown if not)."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "policyworker", "refit-check", "--model", str(model)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout, done.stderr[-3000:], file=sys.stderr)
    return round(time.perf_counter() - start, 3), done.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    r = args.repeats
    row: dict[str, object] = {"bench": "startup"}
    row["baseline"] = {
        "import_torch_s": interpreter_s("import torch", r),
        "import_torch_transformers_s": interpreter_s("import torch, transformers", r),
        "import_torch_megatron_s": interpreter_s("import torch, megatron.core", r),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny")
        ours = {
            "import_driver_s": interpreter_s("import policyworker.driver.policy", r),
            "import_worker_stack_s": interpreter_s(WORKER_STACK, r),
            **policy_timings(model),
        }
        ours["refit_check_s"], ours["refit_check_ok"] = refit_check(model)
    row["ours"] = ours
    base = row["baseline"]["import_torch_s"]  # type: ignore[index]
    row["driver_import_over_torch"] = round(ours["import_driver_s"] / base, 2)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
