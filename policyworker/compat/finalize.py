"""A cheaper end of megatron-core 0.19's `finalize_model_grads`.

Its last step, `reset_model_temporary_tensors`, walks every submodule of the model to zero the
MoE routers' per-step accumulators. Those exist only with the router's expert bias, a global aux
loss or quantile balancing; otherwise the walk finds nothing — ~1000 modules in an MoE model,
a few milliseconds of host time at the end of every train step while the device waits for the
optimizer's launch. `install()` wraps it so the walk runs only when one of those is configured
(the same checks megatron's loop makes per module, made once per call).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from policyworker.compat.version import require_mcore

_original: Callable[..., None] | None = None


def needs_reset(config: Any) -> bool:
    """Whether megatron's reset loop can find anything to reset under this TransformerConfig."""
    balancing = config.moe_router_load_balancing_type
    kinds = balancing if isinstance(balancing, list) else [balancing]
    return bool(config.moe_router_enable_expert_bias) or any(
        "global_aux_loss" in kind or kind == "quantile_balancing" for kind in kinds
    )


def install() -> None:
    """Wrap megatron's `reset_model_temporary_tensors` (idempotent)."""

    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    require_mcore("finalize", "reset_model_temporary_tensors")
    global _original
    if _original is not None:
        return
    _original = original = module.reset_model_temporary_tensors

    def reset_model_temporary_tensors(config: Any, model: list) -> None:
        if needs_reset(config):
            original(config, model)

    module.reset_model_temporary_tensors = reset_model_temporary_tensors
