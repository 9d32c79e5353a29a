"""How a worker is put together: its state (model, DDP, optimizer, scheduler, reference) and the
services built on views of it (refit source, memory residency, checkpointer). Built once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from policyworker.checkpoint.checkpointer import Checkpointer, Trainee
from policyworker.config import PolicyConfig
from policyworker.memory.residency import Residency
from policyworker.model.build import build_gpt_model, global_named_parameters
from policyworker.model.hf_config import ModelShape
from policyworker.model.reference import ReferenceWeights
from policyworker.model.weights import SafetensorsReader, load_hf_weights
from policyworker.parallel.dims import Groups, ParallelDims
from policyworker.refit.source import RefitSource
from policyworker.train.optimizer import (
    build_optimizer,
    build_scheduler,
    grad_buffers,
    optimizer_tensors,
    wrap_ddp,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """What the worker decided before building: config, model shape, layout, device, dtype."""

    cfg: PolicyConfig
    hf_config: Any
    shape: ModelShape
    dims: ParallelDims
    groups: Groups
    device: torch.device
    dtype: torch.dtype


@dataclass(slots=True)
class PolicyState:
    """Everything a memory phase moves or a checkpoint saves, in one place."""

    model: torch.nn.Module
    ddp: torch.nn.Module | None
    optimizer: Any | None
    scheduler: Any | None
    reference: ReferenceWeights | None

    @property
    def forward_model(self) -> torch.nn.Module:
        return self.ddp if self.ddp is not None else self.model


def build_state(
    w: Parts, hf_weights: str | None, *, init_optimizer: bool, init_reference: bool
) -> PolicyState:
    """The model (with `hf_weights` loaded, if any), DDP, optimizer and scheduler, and the
    reference snapshot of the HF weights."""
    config = w.cfg
    model = build_gpt_model(
        w.hf_config,
        w.shape,
        dims=w.dims,
        params_dtype=w.dtype,
        max_seq_len=config.max_total_sequence_length,
        pre_process=w.groups.is_first_stage,
        post_process=w.groups.is_last_stage,
    )
    if hf_weights is not None:
        load_hf_weights(
            global_named_parameters(model),
            SafetensorsReader(hf_weights),
            w.shape,
            tp_rank=w.groups.tp_rank,
            tp_size=w.dims.tp,
        )
    ddp = optimizer = scheduler = None
    if init_optimizer:
        ddp = wrap_ddp(model, distributed_optimizer=config.optimizer.use_distributed_optimizer)
        optimizer = build_optimizer(ddp, config.optimizer, params_dtype=w.dtype)
        scheduler = build_scheduler(optimizer, config.optimizer, config.scheduler)
    reference = None
    if init_reference and hf_weights is not None:
        reference = ReferenceWeights(global_named_parameters(model))
    return PolicyState(
        model=model, ddp=ddp, optimizer=optimizer, scheduler=scheduler, reference=reference
    )


def build_services(w: Parts, state: PolicyState) -> tuple[RefitSource, Residency, Checkpointer]:
    """What refits read, memory phases move and checkpoints save: views of `state`."""
    model, ddp, optimizer = state.model, state.ddp, state.optimizer
    refit = RefitSource(
        lambda: global_named_parameters(model),
        w.shape,
        w.groups,
        w.device,
        w.cfg.refit,
    )
    memory = Residency(
        params=lambda: [*model.parameters(), *model.buffers()],
        grads=lambda: grad_buffers(ddp),
        optimizer=lambda: optimizer_tensors(optimizer),
        device=w.device,
    )
    trainee = Trainee(
        model=model,
        optimizer=optimizer,
        scheduler=state.scheduler,
        groups=w.groups,
        dims=w.dims,
        shape=w.shape,
        hf_config=w.hf_config,
        precision=w.cfg.precision,
        optimizer_config=w.cfg.optimizer,
        scheduler_config=w.cfg.scheduler,
    )
    ckpt = w.cfg.checkpoint
    checkpoints = Checkpointer(
        trainee, verify_integrity=ckpt.verify_integrity, writer_threads=ckpt.writer_threads
    )
    return refit, memory, checkpoints
