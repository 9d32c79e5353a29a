"""Checkpoint runs for `test_checkpoint.py`, under torchrun (or in the test process, world 1).

    python -m torch.distributed.run --nproc_per_node 2 tests/ckpt_multirank.py \
        save|resume MODEL CKPT OUT.pt TP PP [distopt] [overlap] [ep]

`save`: one GRPO step, a sync save (CKPT/sync) and an async save (CKPT/async) of the same state,
three more steps while the async write goes on, then finalize. `resume`: a new worker built from
CKPT/sync runs the same three steps; then `load_checkpoint(CKPT/async)` and the three steps again.
Rank 0 saves what every layout must agree on: logprobs at the save, the metrics of the three
steps and the logprobs after them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from multirank import config, fixed_batch

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


def main() -> None:
    mode, model, ckpt, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    tp, pp, flags = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7:]
    cfg = config(
        model,
        tp=tp,
        pp=pp,
        distopt="distopt" in flags,
        overlap="overlap" in flags,
        ep=2 if "ep" in flags else 1,
    )
    if mode == "save":
        result = run_save(MegatronPolicyWorker(cfg), ckpt)
    else:
        weights, optim = paths(ckpt, "sync")
        worker = MegatronPolicyWorker(cfg, weights_path=str(weights), optimizer_path=str(optim))
        result = run_resume(worker, ckpt)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
