"""A loss that fails on one rank, for the driver's fault tests (imported by the workers too)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch.distributed as dist

from policyworker.losses import ClippedPGLoss


class FailingLoss(ClippedPGLoss):
    """ClippedPGLoss, except that on `rank` it raises ("raise") or SIGKILLs its process ("kill")."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__()
        self.rank, self.how = rank, how

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == self.rank:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure")
        return super().__call__(*args, **kwargs)
