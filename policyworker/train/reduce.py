"""A step's metrics over data-parallel ranks: summed, or min / max (`reduce_metrics`), and each
micro-batch's (NeMo-RL's `all_mb_metrics`); the counts a loss is normalized by are
`train/counts.py`."""

from __future__ import annotations

import torch
import torch.distributed as dist


def reduce_metrics(
    stores: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> dict[str, float]:
    """Each metric over micro-batches and data-parallel ranks: summed (they are globally
    normalized), except `*_min` / `*_max`, which take the min / max."""
    if not stores:
        return {}
    keys = sorted(stores[0])
    stacked = torch.stack([torch.stack([s[k].float().reshape(()) for k in keys]) for s in stores])
    is_min = torch.tensor([k.endswith("_min") for k in keys], device=stacked.device)
    is_max = torch.tensor([k.endswith("_max") for k in keys], device=stacked.device)
    summed = stacked.sum(0)
    extreme = torch.where(is_min, -stacked, stacked).amax(0)  # min as -max(-x): one MAX reduce
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(summed, group=group)
        dist.all_reduce(extreme, op=dist.ReduceOp.MAX, group=group)
    values = torch.where(is_min, -extreme, torch.where(is_max, extreme, summed))
    return dict(zip(keys, values.tolist(), strict=True))


def per_microbatch(
    stores: list[dict[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> dict[str, list[float]]:
    """Each metric's value in every micro-batch of every data-parallel rank (rank order), as
    NeMo-RL's `all_mb_metrics`; each is that micro-batch's share of the global figure."""
    mine = {k: [float(s[k]) for s in stores] for k in (sorted(stores[0]) if stores else [])}
    if group is None or dist.get_world_size(group) == 1:
        return mine
    everyone: list[dict[str, list[float]]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, mine, group=group)
    return {k: [v for rank in everyone for v in rank.get(k, [])] for k in mine}
