"""One optimizer step as a lifecycle: open, add chunks of data, finish (or abort).

`train()` and split-step training (`begin_train_step` / `train_microbatch` /
`finish_train_step` / `abort_train_step`) are the same code: `train()` opens a step, adds its whole
DP-local global batch as one chunk and finishes it.

Normalization. A loss divides by global counts (tokens or sequences over the whole global batch
and all DP ranks), which a streaming caller does not know until the last chunk. So a step whose
loss has one `normalizer` evaluates the loss with every count at 1 — the backward accumulates
plain sums into megatron's fp32 grad buffers — and `finish_step` divides the gradients by the
global count once all chunks are in (inside the fused Adam kernel, with the clip). A loss whose
terms divide by different counts (ClippedPG's positive-example NLL) cannot be rescaled after the
fact: `train()` gives it the counts up front, split-step training refuses it. Metrics are always recomputed at finish from each micro-batch's
detached loss inputs with the true counts, so they equal a step that knew the counts.

Gradients are never reduced over DP before `finish_step`: the schedule is given no
`finalize_model_grads_func` (see `train.optimizer.wrap_ddp`), and `finish_step` runs megatron's
`finalize_model_grads` itself (DP reduce, tied embeddings, sequence-parallel norms). No megatron
hook is swapped in or out, so an abort has nothing to restore. Outside a step the grad buffers
are zero (a step and an abort zero them when they end, and freed gradients come back as zeros),
so a step opens without clearing them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.microbatch import Microbatch, MicrobatchPlan
from policyworker.losses.common import EPS, Loss, LossInputs
from policyworker.model.build import set_mode
from policyworker.ops.logprobs import Head, LogitOptions
from policyworker.parallel.dims import Groups, broadcast_object_from_last_stage
from policyworker.train.counts import sum_over_dp
from policyworker.train.grads import FirstTouchDDP
from policyworker.train.loss_inputs import loss_inputs
from policyworker.train.optimizer import optimizer_step
from policyworker.train.overlap import Overlap
from policyworker.train.reduce import per_microbatch, reduce_metrics
from policyworker.train.routing import RouterRun
from policyworker.train.schedule import run_microbatches, split_evenly
from policyworker.train.teacher import TeacherHeads

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one global batch did."""

    metrics: dict[str, float]
    grad_norm: float
    skipped: bool
    """True when a non-finite gradient made the step a no-op."""
    lr: float
    per_microbatch: dict[str, list[float]]
    """Each metric per micro-batch (every DP rank's): NeMo-RL's `all_mb_metrics`."""


@dataclass(frozen=True, slots=True)
class StepSpec:
    """What a step runs with: the loss, sizes on this rank, and how it is normalized."""

    loss_fn: Loss
    local_rows: int
    """Rows of the global batch on this DP rank; the chunks must add up to it."""
    mbs: int
    eval_mode: bool = False
    known_counts: dict[str, torch.Tensor] | None = None
    """Global counts given up front (losses without one normalizer); None: normalize at finish."""
    balance_scale: float = 1.0
    """What an MoE load-balancing loss's gradient is multiplied by, so that after the step's
    normalization it is divided by the loss tokens (`train.counts.balance_scale_for`)."""
    whole: bool = False
    """The step is one chunk (`train()`): an overlapped grad reduce may start in its backward."""


@dataclass(slots=True)
class OpenStep:
    """An open step: what has been added so far. Gradients live in the DDP grad buffers."""

    spec: StepSpec
    local_counts: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: int = 0
    num_microbatches: int = 0
    records: list[tuple[LossInputs, Mapping[str, torch.Tensor]]] = field(default_factory=list)
    """Per micro-batch (last pipeline stage): detached loss inputs and data, for the metrics."""


def open_step(spec: StepSpec) -> OpenStep:
    """Open a step (refusing a loss it cannot normalize)."""
    if spec.known_counts is None and spec.loss_fn.normalizer is None:
        raise ValueError(
            f"loss_fn: {type(spec.loss_fn).__name__} divides its terms by different counts, so "
            "its gradient cannot be normalized after the fact; use train() for it"
        )
    return OpenStep(spec=spec)  # the gradients are cleared outside a step: nothing to do


def add_chunk(
    step: OpenStep,
    ddp: torch.nn.Module,
    batch: BatchedDataDict,
    *,
    plan: MicrobatchPlan,
    groups: Groups,
    logits: LogitOptions,
    routing: RouterRun | None = None,
    teachers: TeacherHeads | None = None,
    overlap: Overlap | None = None,
) -> None:
    """Forward/backward one chunk of this rank's share (already validated and prepared);
    gradients accumulate locally. Every DP rank adds its chunk at the same time."""
    loss_fn = step.spec.loss_fn
    local = loss_fn.counts(batch)
    counts = step.spec.known_counts or {name: torch.ones_like(v) for name, v in local.items()}
    records: list[tuple[LossInputs, Mapping[str, torch.Tensor]]] = []

    def fn(head: Head, mb: Microbatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs = loss_inputs(head, mb, loss_fn.needs, logits, teachers)
        loss, _ = loss_fn(inputs, mb.data, counts)
        records.append((_detached(inputs), mb.data))
        return _vetoed(loss, head.hidden), {}

    microbatches = split_evenly(batch, plan, step.spec.mbs, loss_fn.rows_per_example, groups)
    set_mode(ddp, training=True)
    deferred = overlap is not None and not step.spec.whole
    with overlap.deferred_grad_sync() if deferred else contextlib.nullcontext():
        run_microbatches(ddp, microbatches, fn, forward_only=step.spec.eval_mode, routing=routing)
    for name, value in local.items():
        step.local_counts[name] = step.local_counts.get(name, 0) + value.detach().float()
    step.rows += batch.size
    step.num_microbatches += len(microbatches)
    step.records += records


def _vetoed(loss: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """`loss`, whose backward makes the gradients NaN when its value is not finite, so that the
    step is skipped on every rank like one with non-finite gradients (the NaN reaches every
    rank's grad norm through the DP reduce and the norm's all-reduce). A loss can be NaN with
    finite gradients (a NaN from a term without gradient): stepping would train on another
    objective. Adds 0 * one element of the model's output [s, b, h] when the loss is finite:
    the value and the gradients are then exactly as without it. No host sync."""
    if not hidden.requires_grad:  # a forward without backward (eval mode): nothing to skip
        return loss
    veto = torch.where(torch.isfinite(loss.detach()), 0.0, float("nan"))
    return loss + veto * hidden.reshape(-1)[0]


def finish_step(
    step: OpenStep,
    ddp: FirstTouchDDP,
    optimizer: Any,
    scheduler: Any,
    *,
    groups: Groups,
    max_grad_norm: float,
    device: torch.device,
    overlap: Overlap | None = None,
) -> StepResult:
    """Reduce, normalize, clip, step the optimizer and the scheduler; the metrics of the step.
    The optimizer step is queued before the metrics are computed and nothing is read back in
    between, so the host's bookkeeping runs while the device steps."""
    spec = step.spec
    counts = spec.known_counts or sum_over_dp(step.local_counts, groups.dp)
    lr = float(optimizer.param_groups[0]["lr"])
    if spec.eval_mode:
        metrics, per_mb = _step_metrics(step, counts, groups)
        return StepResult(metrics, grad_norm=0.0, skipped=False, lr=lr, per_microbatch=per_mb)
    ddp.zero_untouched()
    if overlap is not None:
        overlap.dispatch_grad_reduces()
    finalize_model_grads([ddp], num_tokens=None)
    divisor: torch.Tensor | float = 1.0
    if spec.known_counts is None:
        normalizer = spec.loss_fn.normalizer
        assert normalizer is not None  # open_step refused the others
        divisor = counts[normalizer].double() + EPS  # applied inside the optimizer's kernel
    applied_on_device, norm = optimizer_step(
        optimizer, max_grad_norm=max_grad_norm, device=device, grad_divisor=divisor
    )
    metrics, per_mb = _step_metrics(step, counts, groups)
    applied, grad_norm = bool(applied_on_device), float(norm)
    if applied:
        scheduler.step(increment=1)
        if overlap is not None:
            overlap.after_step()
    else:
        log.warning("non-finite gradient: skipping the optimizer step, weights unchanged")
    zero_grads(ddp, optimizer)  # outside a step the gradients are cleared
    return StepResult(
        metrics, grad_norm=grad_norm, skipped=not applied, lr=lr, per_microbatch=per_mb
    )


def _step_metrics(
    step: OpenStep, counts: dict[str, torch.Tensor], groups: Groups
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The loss's metrics (`_metrics`) with the step's counts and micro-batch count."""
    metrics, per_mb = _metrics(step, counts, groups)
    metrics |= {name: float(value) for name, value in counts.items()}
    metrics["num_microbatches"] = float(step.num_microbatches)
    return metrics, per_mb


def check_batch_sizes(*, gbs: int, mbs: int, rows: int, dp: int) -> int:
    """Validate a step's global and micro-batch sizes; returns this rank's rows (gbs / dp)."""
    for name, value in (("gbs", gbs), ("mbs", mbs)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if mbs % rows:
        raise ValueError(
            f"mbs: expected a multiple of {rows} (the loss reads rows in groups of {rows}, "
            f"which must share a micro-batch), got {mbs}"
        )
    if gbs % dp or (gbs // dp) % mbs:
        raise ValueError(f"gbs: expected a multiple of dp*mbs = {dp}*{mbs}, got {gbs}")
    return gbs // dp


def zero_grads(ddp: torch.nn.Module, optimizer: Any) -> None:
    """Clear the gradients: how a step starts, ends and is aborted (weights, optimizer state
    and scheduler untouched), so that outside a step they count as zero (`train.grads`: the
    buffers keep stale values that the next step's first gradients overwrite)."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()


def summarize(results: list[StepResult]) -> dict[str, Any]:
    """Each metric over global batches (mean; min/max for `*_min`/`*_max`), plus the step
    bookkeeping users plot."""
    out: dict[str, Any] = {}
    for key in results[0].metrics:
        values = [r.metrics[key] for r in results]
        reduce = {"_min": min, "_max": max}.get(key[-4:])
        out[key] = reduce(values) if reduce else sum(values) / len(values)
    out["global_valid_toks"] = sum(r.metrics["global_valid_toks"] for r in results)
    out["global_valid_seqs"] = sum(r.metrics["global_valid_seqs"] for r in results)
    out["num_microbatches"] = sum(int(r.metrics["num_microbatches"]) for r in results)
    out["grad_norm"] = sum(r.grad_norm for r in results) / len(results)
    out["lr"] = results[-1].lr
    out["num_global_batches"] = len(results)
    out["skipped_steps"] = sum(r.skipped for r in results)
    out["all_mb_metrics"] = {
        k: [v for r in results for v in r.per_microbatch[k]] for k in results[0].per_microbatch
    }
    return out


def _metrics(
    step: OpenStep, counts: dict[str, torch.Tensor], groups: Groups
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The loss's metrics of every micro-batch with the true counts: reduced over DP, and per
    micro-batch; every pipeline stage gets those of the last."""
    loss_fn = step.spec.loss_fn
    with torch.no_grad():
        stores = [loss_fn(inputs, data, counts)[1] for inputs, data in step.records]
    both = (reduce_metrics(stores, groups.dp), per_microbatch(stores, groups.dp))
    return broadcast_object_from_last_stage(both, groups)


def _detached(inputs: LossInputs) -> LossInputs:
    values = {f.name: getattr(inputs, f.name) for f in fields(inputs)}
    return LossInputs(**{k: None if v is None else v.detach() for k, v in values.items()})
