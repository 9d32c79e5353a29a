"""A loss that fails on one rank, for the driver's fault tests (imported by the workers too)."""

from __future__ import annotations

import os
import signal
import sys
import types
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


# A loss whose class only the driver can import: its module is registered here, never in a
# worker, so unpickling it there fails (a class defined in a notebook or a `__main__` script).
_DRIVER_ONLY = types.ModuleType("policyworker_tests_driver_only")
sys.modules[_DRIVER_ONLY.__name__] = _DRIVER_ONLY


class DriverOnlyLoss(ClippedPGLoss):
    pass


DriverOnlyLoss.__module__ = _DRIVER_ONLY.__name__
_DRIVER_ONLY.DriverOnlyLoss = DriverOnlyLoss  # type: ignore[attr-defined]


def interrupt(monkeypatch: Any, group: Any, method: str, *, rank: int | None = None) -> None:
    """Make the group's (or a class's) next `method` ("_collect", or "_send" to `rank`) raise
    KeyboardInterrupt once, as a Ctrl-C in a notebook would at that point."""
    cls = group if isinstance(group, type) else type(group)
    real = getattr(cls, method)

    def interrupted(self: Any, *args: Any) -> Any:
        if method == "_send" and args[0] != rank:
            return real(self, *args)
        setattr(cls, method, real)
        raise KeyboardInterrupt

    monkeypatch.setattr(cls, method, interrupted)
