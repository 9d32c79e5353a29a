"""Losses: pure functions of tensors, normalized by global counts."""

from policyworker.losses.clipped_pg import ClippedPGConfig, ClippedPGLoss
from policyworker.losses.common import LossFunction, global_counts, masked_mean
from policyworker.losses.nll import NLLLoss

__all__ = [
    "ClippedPGConfig",
    "ClippedPGLoss",
    "LossFunction",
    "NLLLoss",
    "global_counts",
    "masked_mean",
]
