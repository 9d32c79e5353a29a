"""Losses: pure functions of tensors, normalized by global counts (see `common`)."""

from policyworker.losses.clipped_pg import ClippedPGConfig, ClippedPGLoss
from policyworker.losses.common import Loss, LossInputs, LossNeeds, masked_mean
from policyworker.losses.distillation import (
    DistillationConfig,
    DistillationLoss,
    FullDistillationConfig,
    FullDistillationLoss,
)
from policyworker.losses.dpo import DPOConfig, DPOLoss
from policyworker.losses.nll import NLLLoss

__all__ = [
    "ClippedPGConfig",
    "ClippedPGLoss",
    "DPOConfig",
    "DPOLoss",
    "DistillationConfig",
    "DistillationLoss",
    "FullDistillationConfig",
    "FullDistillationLoss",
    "Loss",
    "LossInputs",
    "LossNeeds",
    "NLLLoss",
    "masked_mean",
]
