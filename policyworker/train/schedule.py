"""Micro-batched forward (and backward) through megatron's pipeline schedules.

`run_microbatches` is where training and every scoring call (`get_logprobs`, top-k) call
`get_forward_backward_func()`, so pipeline parallelism slots in without a second code path
(generation's decode steps call it themselves: one micro-batch of one token per row,
`generation.decode`). `train.step` builds an optimizer step on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.microbatch import Microbatch, MicrobatchPlan
from policyworker.model.build import output_head
from policyworker.ops.logprobs import Head
from policyworker.parallel.dims import Groups
from policyworker.train.routing import RouterRun

log = logging.getLogger(__name__)

# (the logits of [B, S] or packed [1, T] tokens, still as hidden states and output rows; the
# micro-batch) -> (loss scalar, metrics); the loss is ignored when forward-only.
MicrobatchFn = Callable[[Head, Microbatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def run_microbatches(
    model: torch.nn.Module,
    microbatches: list[Microbatch],
    fn: MicrobatchFn,
    *,
    forward_only: bool,
    routing: RouterRun | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run `fn` on each micro-batch's output `Head` via megatron's schedule; returns its
    metrics dicts. `routing`: what an MoE model's routers replay and record."""
    try:
        return _run(model, microbatches, fn, forward_only=forward_only, routing=routing)
    finally:
        if routing is not None:
            routing.routers.reset()


def _run(
    model: torch.nn.Module,
    microbatches: list[Microbatch],
    fn: MicrobatchFn,
    *,
    forward_only: bool,
    routing: RouterRun | None,
) -> list[dict[str, torch.Tensor]]:
    it: Iterator[Microbatch] = iter(microbatches)
    device = microbatches[0].data["input_ids"].device
    moe = get_model_config(model).num_moe_experts is not None

    def forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module) -> Any:
        mb = next(data_iterator)
        ids, pos, packed = mb.model_inputs(device)
        # routers see which tokens are padding (their token counts leave them out)
        extra = {"padding_mask": mb.padding_mask(device)} if moe else {}
        if routing is not None:
            routing.before(mb, training=not forward_only)
        # a Head on the last stage (logits made where they are read), hidden states on the others
        output = model(
            ids, pos, None, packed_seq_params=packed, output_processor=output_head, **extra
        )
        if routing is not None:
            routing.after(mb)

        def loss_func(output: Head) -> tuple[torch.Tensor, torch.Tensor, dict]:
            loss, metrics = fn(output, mb)
            # 3-tuple form: megatron neither divides by micro-batch count nor token count.
            return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics

        return output, loss_func

    shapes = [mb.model_shape for mb in microbatches]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=it,
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=max(s for _, s in shapes),
        micro_batch_size=shapes[0][0],
        forward_only=forward_only,
    )


def split_evenly(
    batch: BatchedDataDict,
    plan: MicrobatchPlan,
    mbs: int,
    rows_per_example: int,
    groups: Groups,
    *,
    train: bool = True,
) -> list[Microbatch]:
    """This rank's micro-batches of a batch, topped up with fillers (no loss, no tokens, no
    rows) so that every data-parallel rank runs as many as the one with the most: training's
    gradient reduction wants it, and any forward of an expert-parallel model (its token
    exchange spans data-parallel ranks)."""
    mbs_list = plan.split(batch, train=train, mbs=mbs, rows_per_example=rows_per_example)
    count = torch.tensor([len(mbs_list)], device=batch["input_ids"].device)
    if groups.dp is not None and dist.get_world_size(groups.dp) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=groups.dp)
    missing = int(count) - len(mbs_list)
    if missing:
        mbs_list += [plan.filler(batch, mbs_list[0], rows_per_example)] * missing
    return mbs_list
