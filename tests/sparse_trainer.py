"""A trainer process for tests/test_sparse_refit.py that is killed mid-transfer: it takes its
sparse-refit baseline, trains a step, writes FOLDER/ready, waits for FOLDER/go (the engines are
then receiving), and streams a refit to TARGETS (JSON) that stops after its first acknowledged
payload — before DONE — writing FOLDER/sent, then waits to be killed.

    python tests/sparse_trainer.py MODEL TARGETS FOLDER
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_batch

from policyworker.config import OptimizerConfig, PolicyConfig
from policyworker.losses import NLLLoss
from policyworker.refit import sparse_link
from policyworker.refit.sparse import KEY_ENV
from policyworker.worker import MegatronPolicyWorker


def main() -> None:
    model, targets, folder = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    cfg = PolicyConfig(
        model_name=model, precision="bfloat16", train_global_batch_size=4,
        train_micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-3),
    )  # fmt: skip
    worker = MegatronPolicyWorker(cfg)
    worker.init_remote_sparse_delta_baseline(shard_rank=0, shard_count=1, transport="zmq")
    worker.train(make_batch(batch=4, seq=12), NLLLoss())
    (folder / "ready").touch()
    while not (folder / "go").exists():
        time.sleep(0.05)
    acknowledged = sparse_link.Link.call

    def call_then_hang(link: sparse_link.Link, frames: list[bytes], timeout_s: float) -> None:
        acknowledged(link, frames, timeout_s)
        (folder / "sent").touch()
        time.sleep(3600)  # killed here

    sparse_link.Link.call = call_then_hang  # type: ignore[method-assign]
    worker.stream_remote_sparse_weights(
        "zmq", targets, transfer_id="killed", api_key_env_var=KEY_ENV, timeout_s=30.0,
        shard_rank=0, shard_count=1, overwrite_names=[],
    )  # fmt: skip


if __name__ == "__main__":
    main()
