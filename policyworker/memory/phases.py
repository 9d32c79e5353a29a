"""The memory phases of a colocated RL step, as targets for the three groups of state.

| phase                        | params | optimizer | grads (no step open) | grads (step open) |
|------------------------------|--------|-----------|----------------------|-------------------|
| prepare_for_lp_inference     | device | host      | freed                | device            |
|   (keep_train_buffers=True)  | device | device    | device               | device            |
| prepare_for_training         | device | device    | device               | device            |
| finish_inference             | host   | host      | freed                | host              |
| offload_before_refit         | device | host      | freed                | host              |
| offload_after_refit          | host   | host      | freed                | host              |
| pause_train_step_with_offloading | host | host    | freed                | device            |

Every phase is a target placement, so each is idempotent and legal after any other. An open
step's gradients are never freed: they stay on the device or are copied to the host and back
exactly. Phases that free device memory also return the allocator's cached blocks to the driver.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from policyworker.memory.residency import Residency, Where
from policyworker.memory.telemetry import log_memory

D, H, F = Where.DEVICE, Where.HOST, Where.FREED


@dataclass(frozen=True, slots=True)
class Phase:
    params: Where
    optimizer: Where
    grads: Where
    grads_in_step: Where
    """Where an open step's gradients go (never FREED)."""

    def targets(self, step_open: bool) -> dict[str, Where]:
        return {
            "params": self.params,
            "grads": self.grads_in_step if step_open else self.grads,
            "optimizer": self.optimizer,
        }


class MemoryPhase(enum.StrEnum):
    """The phases, named as the worker's calls that enter them."""

    LP_INFERENCE = "prepare_for_lp_inference"
    LP_INFERENCE_KEEP_TRAIN_BUFFERS = "prepare_for_lp_inference(keep_train_buffers)"
    TRAINING = "prepare_for_training"
    FINISH_INFERENCE = "finish_inference"
    BEFORE_REFIT = "offload_before_refit"
    AFTER_REFIT = "offload_after_refit"
    PAUSE_TRAIN_STEP = "pause_train_step_with_offloading"


PHASES = {
    MemoryPhase.LP_INFERENCE: Phase(D, H, F, D),
    MemoryPhase.LP_INFERENCE_KEEP_TRAIN_BUFFERS: Phase(D, D, D, D),
    MemoryPhase.TRAINING: Phase(D, D, D, D),
    MemoryPhase.FINISH_INFERENCE: Phase(H, H, F, H),
    MemoryPhase.BEFORE_REFIT: Phase(D, H, F, H),
    MemoryPhase.AFTER_REFIT: Phase(H, H, F, H),
    MemoryPhase.PAUSE_TRAIN_STEP: Phase(H, H, F, D),
}


TRAIN_BUFFERS_KEPT = (MemoryPhase.TRAINING, MemoryPhase.LP_INFERENCE_KEEP_TRAIN_BUFFERS)
"""The phases that keep what training needs on the device (the others release the rest, e.g.
the teacher LM heads of full-vocabulary distillation)."""


def enter_phase(residency: Residency, phase: MemoryPhase, *, step_open: bool) -> None:
    """Move the state to the phase's placement; when it frees anything, return the allocator's
    cached blocks to the driver so that a colocated engine can use them. Logs (DEBUG) after."""
    targets = PHASES[phase].targets(step_open)
    residency.place(targets)
    if residency.device.type == "cuda" and any(w is not D for w in targets.values()):
        torch.cuda.empty_cache()
    log_memory(phase, residency)
