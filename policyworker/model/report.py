"""Reports about a built model that callers of the reference ask for."""

from __future__ import annotations

from typing import Any

import torch


def tensor_parallel_report(model: torch.nn.Module, tp_size: int) -> dict[str, Any]:
    """The seed's `check_tensor_parallel_attributes`: this rank's parameter names (megatron's)
    with megatron's `tensor_model_parallel` attribute set, those without, their count, TP."""
    tp, non_tp = [], []
    for name, param in model.named_parameters():
        (tp if getattr(param, "tensor_model_parallel", False) else non_tp).append(name)
    return {"tp_params": tp, "non_tp_params": non_tp, "total_params": len(tp) + len(non_tp),
            "tp_size": tp_size}  # fmt: skip
