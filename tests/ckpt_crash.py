"""A process that saves a checkpoint, then dies (SIGKILL) during a second save, for
`test_checkpoint.py`: python tests/ckpt_crash.py MODEL DIR FAULT_POINT sync|async"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_batch

from policyworker.config import PolicyConfig
from policyworker.losses import NLLLoss
from policyworker.worker import MegatronPolicyWorker


def main() -> None:
    model, folder, fault, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = PolicyConfig(
        model_name=model,
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=2,
        max_total_sequence_length=64,
    )
    worker = MegatronPolicyWorker(cfg)
    worker.train(make_batch(), NLLLoss())
    worker.save_checkpoint(folder / "a" / "weights", folder / "a" / "optim")
    worker.train(make_batch(), NLLLoss())
    os.environ["POLICYWORKER_FAULT"] = fault
    worker.save_checkpoint(
        folder / "b" / "weights", folder / "b" / "optim", async_save=mode == "async"
    )
    worker.train(make_batch(), NLLLoss())
    worker.finalize_async_save()
    print("survived")


if __name__ == "__main__":
    main()
