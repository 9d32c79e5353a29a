"""Checkpoint runs for `test_checkpoint.py` and `test_moe.py`, under torchrun (or in the test
process, world 1).

    python -m torch.distributed.run --nproc_per_node 2 tests/ckpt_multirank.py JOBS.json

JOBS.json: a list of runs, done in turn in this one launch (megatron's groups set up anew for
each; a launch costs two interpreters' imports, more than a small run): each
`{"mode": "save"|"resume", "model": ..., "ckpt": ..., "out": ..., "tp": 2, "pp": 1,
"flags": ["distopt", "overlap", "ep", "sp", "bias", "lora"]}`.

`save`: one GRPO step, a sync save (CKPT/sync) and an async save (CKPT/async) of the same state,
three more steps while the async write goes on, then finalize. `resume`: a new worker built from
CKPT/sync runs the same three steps; then `load_checkpoint(CKPT/async)` and the three steps again.
Rank 0 saves to OUT what every layout must agree on: logprobs at the save, the metrics of the
three steps and the logprobs after them. A resume runs in another launch than its save.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from multirank import between_runs, config, fixed_batch

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.losses import ClippedPGLoss
from policyworker.worker import MegatronPolicyWorker

STEPS_AFTER = 3


def paths(ckpt: Path, kind: str) -> tuple[Path, Path]:
    return ckpt / kind / "weights", ckpt / kind / "optim"


def shard_of(worker: MegatronPolicyWorker) -> BatchedDataDict:
    data = fixed_batch(worker.shape.vocab_size)
    return data.shard_by_batch_size(worker.dims.dp)[worker.groups.dp_rank]


def logprobs(worker: MegatronPolicyWorker, data: BatchedDataDict) -> torch.Tensor:
    """The whole batch's logprobs (data-parallel shards gathered in dp-rank order)."""
    mine = worker.get_logprobs(data=data)["logprobs"]
    if not dist.is_initialized() or worker.dims.dp == 1:
        return mine
    shards: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (worker.groups.dp_rank, mine))
    by_dp = dict(shards)  # type: ignore[arg-type]
    return torch.cat([by_dp[r] for r in sorted(by_dp)])


def steps(worker: MegatronPolicyWorker, data: BatchedDataDict) -> dict[str, object]:
    train = [worker.train(data, ClippedPGLoss()) for _ in range(STEPS_AFTER)]
    return {"train": train, "lp_final": logprobs(worker, data)}


def run_save(worker: MegatronPolicyWorker, ckpt: Path) -> dict[str, object]:
    data = shard_of(worker)
    worker.train(data, ClippedPGLoss())
    worker.save_checkpoint(*paths(ckpt, "sync"))  # right after the step: before any forward
    out: dict[str, object] = {"lp_at_save": logprobs(worker, data)}
    worker.save_checkpoint(*paths(ckpt, "async"), async_save=True)
    out.update(steps(worker, data))  # the async write goes on meanwhile
    assert worker.finalize_async_save()
    return out


def run_resume(worker: MegatronPolicyWorker, ckpt: Path) -> dict[str, object]:
    data = shard_of(worker)
    out: dict[str, object] = {"lp_at_save": logprobs(worker, data), **steps(worker, data)}
    worker.load_checkpoint(*paths(ckpt, "async"))
    out["async"] = steps(worker, data)
    out["weight_version"] = worker.weight_version
    return out


def run_job(job: dict) -> None:
    flags = job["flags"]
    cfg = config(
        job["model"],
        tp=job["tp"],
        pp=job["pp"],
        distopt="distopt" in flags,
        overlap="overlap" in flags,
        ep=2 if "ep" in flags else 1,
        sp="sp" in flags,
        bias="bias" in flags,
        lora="lora" in flags,
    )
    ckpt = Path(job["ckpt"])
    if job["mode"] == "save":
        worker = MegatronPolicyWorker(cfg)
        result = run_save(worker, ckpt)
    else:
        weights, optim = paths(ckpt, "sync")
        worker = MegatronPolicyWorker(cfg, weights_path=str(weights), optimizer_path=str(optim))
        result = run_resume(worker, ckpt)
    if dist.get_rank() == 0:
        torch.save(result, job["out"])
    worker.shutdown()


def main() -> None:
    for job in json.loads(Path(sys.argv[1]).read_text()):
        run_job(job)
        between_runs()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
