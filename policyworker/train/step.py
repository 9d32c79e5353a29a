"""Micro-batched forward (and backward) through megatron's pipeline schedules.

`run_microbatches` is the one place that calls `get_forward_backward_func()`: inference
(`get_logprobs`, top-k) and training both go through it, so pipeline parallelism slots in
without a second code path. `train_global_batch` adds the global normalization, the non-finite
check, the optimizer and the scheduler step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.losses.common import Loss, LossInputs
from policyworker.model.build import batch_major_logits
from policyworker.ops.logprobs import index_logprobs, token_logprobs, vocab_parallel_entropy
from policyworker.parallel.dims import Groups, broadcast_object_from_last_stage
from policyworker.train.optimizer import optimizer_step

log = logging.getLogger(__name__)

# (logits [B, S, V/tp], micro-batch) -> (loss scalar, metrics); loss is ignored when forward-only.
MicrobatchFn = Callable[
    [torch.Tensor, BatchedDataDict], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


def trim_to_longest(mb: BatchedDataDict) -> BatchedDataDict:
    """Drop the all-padding tail of a micro-batch (per-token fields [B, S] are cut to max length)."""
    seq = mb["input_ids"].shape[1]
    longest = int(mb["input_lengths"].max())
    if longest == seq:
        return mb
    return BatchedDataDict(
        {
            k: v[:, :longest]
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq
            else v
            for k, v in mb.items()
        }
    )


def run_microbatches(
    model: torch.nn.Module,
    microbatches: list[BatchedDataDict],
    fn: MicrobatchFn,
    *,
    forward_only: bool,
) -> list[dict[str, torch.Tensor]]:
    """Run `fn` on each micro-batch's logits via megatron's schedule; returns its metrics dicts."""
    it: Iterator[BatchedDataDict] = iter(microbatches)

    def forward_step(data_iterator: Iterator[BatchedDataDict], model: torch.nn.Module) -> Any:
        mb = next(data_iterator)
        ids = mb["input_ids"]
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        # [B, S, V/tp] on the last stage (hidden states on the others)
        logits = model(ids, pos, None, output_processor=batch_major_logits)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            loss, metrics = fn(output, mb)
            # 3-tuple form: megatron neither divides by micro-batch count nor token count.
            return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics

        return logits, loss_func

    seq = max(mb["input_ids"].shape[1] for mb in microbatches)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=it,
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=microbatches[0].size,
        forward_only=forward_only,
    )


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


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one global batch did."""

    metrics: dict[str, float]
    grad_norm: float
    applied: bool
    skipped: bool
    """True when a non-finite gradient made the step a no-op."""
    lr: float


def make_loss_fn(
    loss_fn: Loss,
    *,
    temperature: float,
    groups: Groups,
    counts: dict[str, torch.Tensor],
) -> MicrobatchFn:
    """Logits -> what the loss asked for (`loss_fn.needs`) -> the loss, for one micro-batch."""
    needs = loss_fn.needs
    tp = {"temperature": temperature, "tp_group": groups.tp}

    def fn(
        logits: torch.Tensor, mb: BatchedDataDict
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs = LossInputs(
            logprobs=token_logprobs(logits, mb["input_ids"], **tp, tp_rank=groups.tp_rank)
            if needs.logprobs
            else None,
            entropy=vocab_parallel_entropy(logits, **tp) if needs.entropy else None,
            index_logprobs=index_logprobs(logits, mb[needs.index_key], **tp, tp_rank=groups.tp_rank)
            if needs.index_key is not None
            else None,
        )
        return loss_fn(inputs, mb, counts)

    return fn


def global_counts(
    loss_fn: Loss, batch: BatchedDataDict, dp_group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """The loss's counts (`global_valid_toks`, ...) summed over this global batch and DP ranks."""
    local = loss_fn.counts(batch)
    names = sorted(local)
    stacked = torch.stack([local[n].float() for n in names])
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(stacked, group=dp_group)
    return dict(zip(names, stacked.unbind(), strict=True))


def train_global_batch(
    *,
    ddp: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    batch: BatchedDataDict,
    loss_fn: Loss,
    micro_batch_size: int,
    temperature: float,
    max_grad_norm: float,
    groups: Groups,
    eval_mode: bool,
) -> StepResult:
    """Forward/backward one (DP-local) global batch, then clip, step and schedule unless eval."""
    device = batch["input_ids"].device
    counts = global_counts(loss_fn, batch, groups.dp)
    fn = make_loss_fn(loss_fn, temperature=temperature, groups=groups, counts=counts)
    microbatches = [trim_to_longest(mb) for mb in batch.make_microbatch_iterator(micro_batch_size)]
    lr = float(optimizer.param_groups[0]["lr"])
    if not eval_mode:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
    stores = run_microbatches(ddp, microbatches, fn, forward_only=eval_mode)
    # Losses live on the last pipeline stage; every stage reports them.
    metrics = broadcast_object_from_last_stage(reduce_metrics(stores, groups.dp), groups)
    metrics |= {name: float(value) for name, value in counts.items()}
    metrics["num_microbatches"] = float(len(microbatches))
    if eval_mode:
        return StepResult(metrics=metrics, grad_norm=0.0, applied=False, skipped=False, lr=lr)
    applied, grad_norm = optimizer_step(optimizer, max_grad_norm=max_grad_norm, device=device)
    if applied:
        scheduler.step(increment=1)
    else:
        log.warning("non-finite gradient: skipping the optimizer step, weights unchanged")
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
    return StepResult(
        metrics=metrics, grad_norm=grad_norm, applied=applied, skipped=not applied, lr=lr
    )
