"""The counts a step is normalized by, in one place: summed over the data-parallel ranks
(`sum_over_dp`), handed up front to a loss without one normalizer (`known_counts_for`), and the
scale that makes the load-balancing loss's gradient a per-loss-token one (`balance_scale_for`).
A loss's own local counts are `losses.common.valid_counts` and `Loss.counts`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.losses.common import EPS, Loss, valid_counts
from policyworker.parallel.dims import Groups


def sum_over_dp(
    local: dict[str, torch.Tensor], dp_group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """Counts (`global_valid_toks`, ...) summed over the data-parallel ranks."""
    names = sorted(local)
    stacked = torch.stack([local[n].float() for n in names])
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(stacked, group=dp_group)
    return dict(zip(names, stacked.unbind(), strict=True))


def known_counts_for(
    loss_fn: Loss, batch: BatchedDataDict, groups: Groups
) -> dict[str, torch.Tensor] | None:
    """The global counts `train()` hands a loss without one normalizer; None for the others."""
    return None if loss_fn.normalizer is not None else sum_over_dp(loss_fn.counts(batch), groups.dp)


def balance_scale_for(
    loss_fn: Loss, batch: BatchedDataDict, known: dict[str, torch.Tensor] | None, groups: Groups
) -> float:
    """The load-balancing gradient's scale for a step of `batch` (this rank's share of a global
    batch): 1 / loss tokens with counts given up front, else loss normalizer / loss tokens (the
    finish divides every gradient by the normalizer). Collective over DP."""
    toks = sum_over_dp(valid_counts(batch), groups.dp)["global_valid_toks"]
    if known is not None:
        return 1.0 / (float(toks) + EPS)
    normalizer = loss_fn.normalizer
    assert normalizer is not None
    if normalizer == "global_valid_toks":
        return 1.0
    return float(sum_over_dp(loss_fn.counts(batch), groups.dp)[normalizer]) / (float(toks) + EPS)
