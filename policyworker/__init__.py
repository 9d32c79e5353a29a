"""policyworker: the training side of RL post-training for LLMs, on megatron-core.

    from policyworker import MegatronPolicyWorker, PolicyConfig, BatchedDataDict, ClippedPGLoss

The names in `__all__` are the public API; everything else is reachable by module path but may
change. They are imported on first use, so `python -m policyworker` answers a bad command line
without loading megatron-core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from policyworker.compat.process import defer_megatron_compile

defer_megatron_compile()  # before anything can import megatron-core (compat/process.py)

_HOME = {
    "BatchValidationError": "policyworker.data.contract",
    "BatchedDataDict": "policyworker.data.batched_data_dict",
    "ClippedPGConfig": "policyworker.losses",
    "ClippedPGLoss": "policyworker.losses",
    "DPOConfig": "policyworker.losses",
    "DPOLoss": "policyworker.losses",
    "DistillationConfig": "policyworker.losses",
    "DistillationLoss": "policyworker.losses",
    "GenerationProcess": "policyworker.generation.process",
    "Loss": "policyworker.losses",
    "MegatronPolicyWorker": "policyworker.worker",
    "NLLLoss": "policyworker.losses",
    "PhaseError": "policyworker.memory.residency",
    "Policy": "policyworker.driver.policy",
    "PolicyConfig": "policyworker.config",
    "RefitError": "policyworker.refit.layout",
    "WorkerError": "policyworker.driver.group",
    "load_config": "policyworker.config",
}

__all__ = [
    "BatchValidationError",
    "BatchedDataDict",
    "ClippedPGConfig",
    "ClippedPGLoss",
    "DPOConfig",
    "DPOLoss",
    "DistillationConfig",
    "DistillationLoss",
    "GenerationProcess",
    "Loss",
    "MegatronPolicyWorker",
    "NLLLoss",
    "PhaseError",
    "Policy",
    "PolicyConfig",
    "RefitError",
    "WorkerError",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'policyworker' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # import once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from policyworker.config import PolicyConfig, load_config
    from policyworker.data.batched_data_dict import BatchedDataDict
    from policyworker.data.contract import BatchValidationError
    from policyworker.driver.group import WorkerError
    from policyworker.driver.policy import Policy
    from policyworker.generation.process import GenerationProcess
    from policyworker.losses import (
        ClippedPGConfig,
        ClippedPGLoss,
        DistillationConfig,
        DistillationLoss,
        DPOConfig,
        DPOLoss,
        Loss,
        NLLLoss,
    )
    from policyworker.memory.residency import PhaseError
    from policyworker.refit.layout import RefitError
    from policyworker.worker import MegatronPolicyWorker
