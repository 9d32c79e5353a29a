"""The trainer: one rank's DDP model, optimizer, scheduler and micro-batch plan, and the optimizer
step that is open on them (`train.step` is the step itself).

    trainer.train(batch, loss)                  # one step per global batch of `batch`
    trainer.begin(loss); trainer.add(chunk) ...; trainer.finish()   # one step, streamed
    trainer.abort(zero=True)                    # drop the open step

Inputs reach it validated against the batch contract (the worker's facade does that); it checks
what is about steps — sizes, the open step, rows left — before any state changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from policyworker.config import finite
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import FULL_PAYLOAD, ROUTES, BatchRules, check_routes
from policyworker.data.microbatch import MicrobatchPlan
from policyworker.losses.common import Loss
from policyworker.model.routers import Routers
from policyworker.ops.logprobs import LogitOptions
from policyworker.parallel.dims import Groups
from policyworker.train.counts import balance_scale_for, known_counts_for
from policyworker.train.optimizer import optimizer_parts, optimizer_state_bytes
from policyworker.train.overlap import Overlap
from policyworker.train.routing import RouterRun
from policyworker.train.step import (
    OpenStep,
    StepResult,
    StepSpec,
    add_chunk,
    check_batch_sizes,
    finish_step,
    open_step,
    summarize,
    zero_grads,
)
from policyworker.train.teacher import TeacherHeads


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSettings:
    """What every step runs with, from the worker's config."""

    gbs: int
    """Default global batch (rows over all DP ranks)."""
    mbs: int
    """Default micro-batch (rows)."""
    logits: LogitOptions
    """Temperature, vocabulary split and chunking of the logits."""
    max_grad_norm: float
    rules: BatchRules
    """The context and vocabulary every batch meets."""
    router_replay: bool = False
    """Every step replays the batch's `routed_experts` (which it must have)."""


class Trainer:
    """Owns the optimizer step of one rank; every DP rank calls it in step."""

    def __init__(
        self,
        *,
        ddp: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        plan: MicrobatchPlan,
        groups: Groups,
        dp: int,
        device: torch.device,
        settings: TrainSettings,
        teachers: TeacherHeads,
        overlap: Overlap,
        routers: Routers | None = None,
    ) -> None:
        self.ddp, self.optimizer, self.scheduler = ddp, optimizer, scheduler
        self.plan, self.groups, self.dp, self.device = plan, groups, dp, device
        self.settings = settings
        self.routers = routers
        """An MoE model's routers: replay, the balancing loss, the tokens per expert."""
        self.teachers = teachers
        """Teachers' LM-head shards (full-vocabulary distillation from hidden states)."""
        self.overlap = overlap
        """DDP's overlapped gradient reduce and parameter gather."""
        self._step: OpenStep | None = None
        self._state_bytes = (-1, 0)
        """(optimizer state entries, `optimizer_state_bytes`) when last counted."""

    @property
    def step_open(self) -> bool:
        return self._step is not None

    @property
    def open_loss(self) -> Loss:
        """The loss of the open step."""
        return self.require_step("train_microbatch").spec.loss_fn

    @property
    def steps_done(self) -> int:
        return int(self.scheduler.num_steps)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Loss,
        *,
        eval_mode: bool,
        gbs: int | None,
        mbs: int | None,
    ) -> dict[str, Any]:
        """One step per global batch of `data` (each a step of one chunk); the metrics."""
        self.require_no_step("train")
        gbs, mbs = self._sizes(gbs, mbs)
        local = check_batch_sizes(gbs=gbs, mbs=mbs, rows=loss_fn.rows_per_example, dp=self.dp)
        b = data.size
        if b % local:
            raise ValueError(
                f"batch size {b}: expected a multiple of the per-rank global batch {local}"
            )
        self.plan.check(
            data["input_lengths"].tolist(), train=True, rows_per_example=loss_fn.rows_per_example
        )
        data = self._on_device(loss_fn.prepare_batch(data))
        results = []
        for start in range(0, b, local):
            chunk = data.slice(start, start + local)
            known = known_counts_for(loss_fn, chunk, self.groups)
            scale = 1.0
            if self._balancing:
                scale = balance_scale_for(loss_fn, chunk, known, self.groups)
            spec = StepSpec(
                loss_fn,
                local,
                mbs,
                eval_mode=eval_mode,
                known_counts=known,
                balance_scale=scale,
                whole=True,
            )
            self._step = self._open(spec)
            self._add(chunk)
            results.append(self._finish())
        return self._summarize(results)

    def begin(self, loss_fn: Loss, gbs: int | None, mbs: int | None) -> None:
        """Open a step (the gradients are zero) of `gbs / dp` rows on this rank."""
        self.require_no_step("begin_train_step")
        gbs, mbs = self._sizes(gbs, mbs)
        local = check_batch_sizes(gbs=gbs, mbs=mbs, rows=loss_fn.rows_per_example, dp=self.dp)
        if self._balancing and loss_fn.normalizer != "global_valid_toks":
            raise ValueError(
                f"loss_fn: {type(loss_fn).__name__} is normalized by {loss_fn.normalizer}, so the "
                "load-balancing loss (normalized by loss tokens) cannot share a streamed step; "
                "use train() for it"
            )
        self._step = self._open(StepSpec(loss_fn, local, mbs))

    def add(self, data: BatchedDataDict) -> None:
        """Forward/backward a chunk of the open step; on an error inside, the step is aborted."""
        step = self.require_step("train_microbatch")
        spec, b = step.spec, data.size
        if b % spec.mbs or step.rows + b > spec.local_rows:
            raise ValueError(
                f"data: expected a multiple of mbs={spec.mbs} rows and at most the "
                f"{spec.local_rows - step.rows} rows left of this rank's global batch, got {b}"
            )
        lengths = data["input_lengths"].tolist()
        self.plan.check(lengths, train=True, rows_per_example=spec.loss_fn.rows_per_example)
        self._add(self._on_device(spec.loss_fn.prepare_batch(data)))

    def finish(self) -> dict[str, Any]:
        """DP-reduce and normalize the gradients, clip, step optimizer and scheduler; metrics.
        A step that is not open or not whole is refused before anything moves."""
        step = self.require_step("finish_train_step")
        if step.rows != step.spec.local_rows:
            raise ValueError(
                f"finish_train_step: the step holds {step.rows} of this rank's "
                f"{step.spec.local_rows} rows (gbs / dp); add the rest or abort_train_step()"
            )
        return self._summarize([self._finish()])

    def abort(self, *, zero: bool) -> None:
        """Drop the open step; `zero`: zero its gradients (False: the caller frees them where
        they are, e.g. on the host)."""
        self.require_step("abort_train_step")
        self._step = None
        if zero:
            self._zero()

    def set_lr(self, lr: float) -> None:
        """A new peak lr for the schedule, from now on."""
        if not (finite(lr) and lr > 0):
            raise ValueError(f"lr: expected a finite number > 0, got {lr!r}")
        self.scheduler.max_lr = lr
        for group in self.optimizer.param_groups:
            group["max_lr"] = group["lr"] = lr

    def check_batch(self, data: BatchedDataDict, loss_fn: Loss) -> None:
        """The batch against the contract and the loss's keys (`BatchValidationError`)."""
        s = self.settings
        required = loss_fn.required_keys + ((ROUTES,) if s.router_replay else ())
        s.rules.check(data, required)
        if s.router_replay:
            assert self.routers is not None
            r = self.routers
            check_routes(data, layers=r.num_layers, topk=r.topk, experts=r.experts)
        if loss_fn.needs.teacher_payload is not None:
            self.teachers.check_batch(data, loss_fn.needs.teacher_payload)

    def checked(self, call: str, *, step_open: bool | None) -> Trainer:
        """This trainer, if `call` may use it: a step is open (`step_open=True`) or not (False;
        None: either)."""
        if step_open:
            self.require_step(call)
        elif step_open is False:
            self.require_no_step(call)
        return self

    def require_no_step(self, call: str) -> None:
        if self._step is not None:
            raise ValueError(
                f"{call}: a train step is open; finish_train_step() or abort_train_step() first"
            )

    def require_step(self, call: str) -> OpenStep:
        if self._step is None:
            raise ValueError(f"{call}: no train step is open; begin_train_step() first")
        return self._step

    def _open(self, spec: StepSpec) -> OpenStep:
        step = open_step(spec)
        if self.routers is not None:
            self.routers.reset_counts()  # an aborted step's counts do not carry over
        return step

    def _sizes(self, gbs: int | None, mbs: int | None) -> tuple[int, int]:
        s = self.settings
        return (s.gbs if gbs is None else gbs), (s.mbs if mbs is None else mbs)

    def _add(self, data: BatchedDataDict) -> None:
        assert self._step is not None
        try:
            if self._step.spec.loss_fn.needs.teacher_payload == "hidden_states":
                self.teachers.stage()
            add_chunk(
                self._step,
                self.ddp,
                data,
                plan=self.plan,
                groups=self.groups,
                logits=self.settings.logits,
                routing=self._routing(),
                teachers=self.teachers,
                overlap=self.overlap,
            )
        except BaseException as e:
            self._step = None
            self._zero()
            e.add_note("policyworker: the open train step was aborted (gradients dropped)")
            raise

    def _zero(self) -> None:
        """Zero the gradients of a dropped step (after any reduce still in flight)."""
        self.overlap.drain_grad_reduces()
        zero_grads(self.ddp, self.optimizer)

    def _on_device(self, data: BatchedDataDict) -> BatchedDataDict:
        """The batch on the device, but a teacher's full payload: it can be far larger than the
        rest ([B, S, V] logits), so each micro-batch's rows move when it runs."""
        rest = BatchedDataDict({k: v for k, v in data.items() if k != FULL_PAYLOAD})
        moved = rest.to(self.device)
        if FULL_PAYLOAD in data:
            moved[FULL_PAYLOAD] = data[FULL_PAYLOAD]
        return moved

    @property
    def _balancing(self) -> bool:
        """The routers add a load-balancing loss (its type says)."""
        return self.routers is not None and self.routers.balance.adds_loss

    def _routing(self) -> RouterRun | None:
        if self.routers is None:
            return None
        assert self._step is not None
        scale, replay = self._step.spec.balance_scale, self.settings.router_replay
        return RouterRun(routers=self.routers, replay=replay, record=False, balance_scale=scale)

    def _finish(self) -> StepResult:
        step, self._step = self._step, None
        assert step is not None
        try:
            result = finish_step(
                step,
                self.ddp,
                self.optimizer,
                self.scheduler,
                groups=self.groups,
                max_grad_norm=self.settings.max_grad_norm,
                device=self.device,
                overlap=self.overlap,
            )
            if self.routers is not None:
                result.metrics.update(self.routers.take(result.metrics["global_valid_toks"]))
            return result
        except BaseException:
            self._zero()
            raise

    def _summarize(self, results: list[StepResult]) -> dict[str, Any]:
        metrics = summarize(results)
        metrics["optimizer_state_bytes"] = self._optimizer_state_bytes()
        return metrics

    def _optimizer_state_bytes(self) -> int:
        """`optimizer_state_bytes`, counted again only when the optimizer's state has gained
        entries (its first step): the count walks every state tensor (~8 ms of host time a
        step for an MoE model's ~5600), and the sizes never change after."""
        entries = sum(len(part.optimizer.state) for part in optimizer_parts(self.optimizer))
        if entries != self._state_bytes[0]:
            self._state_bytes = (entries, optimizer_state_bytes(self.optimizer))
        return self._state_bytes[1]
