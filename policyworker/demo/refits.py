"""How the demo's transformers engine gets the weights before each GRPO step, chosen once:
`IpcRefit` (every byte, over CUDA IPC / shared memory, colocated) or `SparseRefit` (the
sparse-delta transport over TCP: only the elements that changed since the last refit).

Both run in the colocated order of memory phases: the trainer's optimizer state and gradients
leave the device before the hand-over, everything after it. Each returns its metrics row part.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from policyworker.driver.policy import Policy, rank_flags
from policyworker.generation.process import GenerationProcess
from policyworker.refit.sparse import KEY_ENV


class IpcRefit:
    """Rank 0 streams to the one engine; the other ranks take part in the gathers only."""

    def __init__(self, policy: Policy, engine: GenerationProcess) -> None:
        self.policy, self.engine = policy, engine

    def __call__(self, step: int) -> dict[str, Any]:
        self.policy.offload_before_refit()
        start = time.perf_counter()
        self.engine.begin_refit_ipc(self.policy.get_zmq_address()[0])
        self.policy.stream_weights_via_ipc_zmq(send=rank_flags(self.policy.world_size, [0]))
        version = self.engine.end_refit()
        refit_s = time.perf_counter() - start
        self.policy.offload_after_refit()
        return {"refit_s": refit_s, "weight_version": version}


class SparseRefit:
    """Every rank produces its share of the tensors (tensor i: rank i % world); the engine
    applies a version once all of it arrived. The baseline is the workers' weights at start;
    the engine starts from the HF folder, so the run's first refit sends every tensor whole
    (a resumed run's workers are not at the folder's weights)."""

    def __init__(self, policy: Policy, engine: GenerationProcess, key: str) -> None:
        """`key`: the run's key, which the workers hold as `KEY_ENV`."""
        self.policy, self.engine = policy, engine
        self.ranks = list(range(policy.world_size))
        info = policy.init_remote_sparse_delta_baseline(
            shard_rank=self.ranks, shard_count=len(self.ranks), transport="zmq"
        )
        self.full_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
        self.target = engine.bind_sparse(api_key=key)
        self.first = True

    def __call__(self, step: int) -> dict[str, Any]:
        self.policy.offload_before_refit()
        start = time.perf_counter()
        transfer = f"step{step}"
        self.engine.begin_refit_sparse(transfer, len(self.ranks))
        per_rank = self.policy.stream_remote_sparse_weights(
            "zmq", [self.target], transfer_id=transfer, api_key_env_var=KEY_ENV,
            timeout_s=self.engine.timeout_s, shard_rank=self.ranks,
            shard_count=len(self.ranks), overwrite_names=[], full_resync=self.first,
        )  # fmt: skip
        version = self.engine.end_refit()
        self.policy.finish_remote_sparse_delta_sync(succeeded=True)
        refit_s = time.perf_counter() - start
        self.policy.offload_after_refit()
        self.first = False
        total = {k: sum(s[k] for s in per_rank) for k in per_rank[0]}
        return {
            "refit_s": refit_s,
            "weight_version": version,
            "refit_changed_fraction": total["changed_elements"] / total["total_elements"],
            "refit_wire_bytes": total["wire_bytes"],
            "refit_full_bytes": self.full_bytes,
        }
