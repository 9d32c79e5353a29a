"""A script that builds a worker under torchrun (CP2, packed) inside `main()`, trains, starts an
async save and simply ends: no finalize, no shutdown, no destroy_process_group, and the worker
garbage-collected before exit (the hook held it weakly: its save was lost). For
`test_faults.py`: the process must exit 0 with the save committed.

    python -m torch.distributed.run --nproc_per_node 2 tests/exit_script.py MODEL CKPT
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from multirank import config, fixed_batch

from policyworker.losses import ClippedPGLoss
from policyworker.worker import MegatronPolicyWorker


def main() -> None:
    model, ckpt = sys.argv[1], Path(sys.argv[2])
    worker = MegatronPolicyWorker(config(model, tp=1, pp=1, cp=2, pack=True))
    worker.train(fixed_batch(worker.shape.vocab_size), ClippedPGLoss())
    worker.prepare_refit_info()
    worker.save_checkpoint(ckpt / "weights", ckpt / "optim", async_save=True)


main()
gc.collect()  # the worker is gone: its pending save must not be
