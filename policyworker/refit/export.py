"""The whole model in the Hugging Face layout, one tensor at a time, on every pipeline stage.

`refit_info` needs no tensor at all: each stage runs its mappings on meta tensors of the full
(TP-gathered) shapes, and the stages' lists are gathered over the pipeline group. `model_tensors`
yields every tensor of the model in that order: a stage's own tensors come from the export
(TP shards gathered, each routed expert broadcast by its EP rank), the other stages' are
broadcast over the pipeline group by their owner. At most one tensor (plus its TP shards) is
materialized at a time, never a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from policyworker.model.hf_config import ModelShape
from policyworker.model.weights import export_hf_weights, full_meta, mappings, on_disk
from policyworker.parallel.dims import Groups
from policyworker.refit.layout import RefitInfo


def stage_info(
    params: dict[str, torch.Tensor], shape: ModelShape, groups: Groups
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(hf_name, shape, dtype) of this stage's exported tensors, computed on meta tensors."""
    return [
        (name, tuple(t.shape), t.dtype) for name, t in on_disk(_meta(params, shape, groups), shape)
    ]


def _meta(
    params: dict[str, torch.Tensor], shape: ModelShape, groups: Groups
) -> Iterator[tuple[str, torch.Tensor]]:
    for m in mappings(shape, dist.get_world_size(groups.tp)):
        meta = full_meta(m, params, shape, groups)
        if meta is not None:
            yield from zip(m.hf, m.to_hf(meta, shape), strict=True)


def refit_info(params: dict[str, torch.Tensor], shape: ModelShape, groups: Groups) -> RefitInfo:
    """`{hf_name: (shape, dtype)}` of the whole model (every pipeline stage), in send order."""
    mine = stage_info(params, shape, groups)
    stages: list[object] = [mine]
    if groups.pp_size > 1:
        stages = [None] * groups.pp_size
        dist.all_gather_object(stages, mine, group=groups.pp)
    return {name: (s, dtype) for stage in stages for name, s, dtype in stage}  # type: ignore[union-attr]


def owners(params: dict[str, torch.Tensor], shape: ModelShape, groups: Groups) -> list[int]:
    """The pipeline stage of each refit-info name, in order."""
    mine = len(stage_info(params, shape, groups))
    counts: list[object] = [mine]
    if groups.pp_size > 1:
        counts = [None] * groups.pp_size
        dist.all_gather_object(counts, mine, group=groups.pp)
    return [stage for stage, n in enumerate(counts) for _ in range(n)]  # type: ignore[arg-type]


def model_tensors(
    params: dict[str, torch.Tensor],
    shape: ModelShape,
    groups: Groups,
    info: RefitInfo,
    stage_of: list[int],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) of the whole model in `info` order, on every rank of the pipeline.

    Collective over TP and PP: every rank of the model-parallel group iterates in step.
    """
    own = export_hf_weights(params, shape, groups)
    for (name, (dims, dtype)), stage in zip(info.items(), stage_of, strict=True):
        if stage == groups.pp_rank:
            exported, tensor = next(own)
            assert exported == name, (exported, name)
            tensor = tensor.contiguous()
        else:
            tensor = torch.empty(dims, dtype=dtype, device=device)
        if groups.pp_size > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(groups.pp, stage), group=groups.pp)
        yield name, tensor
