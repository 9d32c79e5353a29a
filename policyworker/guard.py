"""What a worker call checks before it delegates (`Guard`): the config is the one the worker was
built from, the state it needs is on the device, the trainer exists and has — or has not — a
step open, and no failed checkpoint load left the state damaged. A refused call raises
`ValueError` (or the memory's `PhaseError`) and changes nothing."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from policyworker.config import PolicyConfig
from policyworker.schema import first_difference, first_value

if TYPE_CHECKING:
    from policyworker.checkpoint.checkpointer import Checkpointer
    from policyworker.memory.residency import Residency
    from policyworker.train.trainer import Trainer


class Guard:
    """One worker's checks, on views of its config, memory, checkpointer and trainer."""

    def __init__(
        self,
        cfg: PolicyConfig,
        memory: Residency,
        checkpoints: Checkpointer,
        trainer: Trainer | None,
    ) -> None:
        self.cfg, self.memory, self.checkpoints, self._trainer = cfg, memory, checkpoints, trainer
        self.as_built = copy.deepcopy(cfg)  # what every service was built from

    @property
    def step_open(self) -> bool:
        return self._trainer is not None and self._trainer.step_open

    def require(self, call: str, *groups: str) -> None:
        """Refuse `call` while the config differs from the one the worker was built from (the
        services read it once, some parts live: a change would act in some places and not in
        others, unchecked), or while the named groups of state are off the device."""
        changed = first_difference(self.as_built, self.cfg)
        if changed is not None:
            raise ValueError(
                f"{call}: cfg.{changed} changed after the worker was built (now "
                f"{first_value(self.cfg, changed)!r}); a worker's config is fixed: build a new "
                "worker for another one"
            )
        self.memory.require(call, *groups)

    def trainer(
        self, call: str, *groups: str, step_open: bool | None = False, damaged_ok: bool = False
    ) -> Trainer:
        """The trainer, if `call` may use it (see `Trainer.checked`), the state is intact and
        the named `groups` of state are on the device (`require`)."""
        if self._trainer is None:
            raise ValueError("init_optimizer=False: this worker cannot train")
        if not damaged_ok:
            self.checkpoints.require_intact(call)
        trainer = self._trainer.checked(call, step_open=step_open)
        if groups:
            self.require(call, *groups)
        return trainer
