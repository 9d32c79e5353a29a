"""How a worker is put together: its layout, its state (model, DDP, optimizer, scheduler,
reference) and the services built on views of it (trainer, scorer, refit source, memory
residency, checkpointer). Built once; a worker is shut down at interpreter exit."""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import tensor_parallel

from policyworker.checkpoint.checkpointer import Checkpointer, Trainee, finalize_unfinished
from policyworker.compat import expert_bias, finalize, mla, router
from policyworker.compat.cpu import apply_cpu_patches
from policyworker.config import PolicyConfig
from policyworker.data.contract import BatchRules
from policyworker.data.microbatch import MicrobatchPlan, build_plan
from policyworker.generation.decode import Decoder
from policyworker.generation.sampler import Sampler
from policyworker.memory.residency import Residency
from policyworker.model import lora
from policyworker.model.balance import balance_of
from policyworker.model.build import (
    build_gpt_model,
    global_named_parameters,
    global_named_weights,
)
from policyworker.model.hf_config import ModelShape, load_hf_config, model_shape
from policyworker.model.latent import DuplicatedLinear
from policyworker.model.layout_checks import check_layout, check_peft, check_sliding_window
from policyworker.model.lora import Adapters, BaseReference
from policyworker.model.paths import ForwardPaths, choose_paths
from policyworker.model.reference import ReferenceWeights
from policyworker.model.routers import Routers
from policyworker.model.weights import SafetensorsReader, check_hf_folder, load_hf_weights
from policyworker.ops.logprobs import LogitOptions
from policyworker.ops.sampling import pad_token
from policyworker.parallel.dims import Groups, ParallelDims, setup_parallel
from policyworker.refit.sources import Refit
from policyworker.refit.weights import RefitWeights
from policyworker.train.optimizer import (
    build_optimizer,
    build_scheduler,
    grad_buffers,
    optimizer_tensors,
    wrap_ddp,
)
from policyworker.train.overlap import Overlap
from policyworker.train.scoring import Scorer
from policyworker.train.teacher import TeacherHeads, VocabSlice
from policyworker.train.trainer import Trainer, TrainSettings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    paths: ForwardPaths
    """What every forward of the model runs (attention per phase, generation's matmul rows)."""
    rules: BatchRules
    """The context and vocabulary every batch meets (every service checks batches by it)."""


@dataclass(slots=True)
class PolicyState:
    """Everything a memory phase moves or a checkpoint saves, in one place."""

    model: torch.nn.Module
    ddp: torch.nn.Module | None
    optimizer: Any | None
    scheduler: Any | None
    reference: ReferenceWeights | BaseReference | None
    overlap: Overlap
    """DDP's overlapped reduce and gather: `overlap.sync_params()` before parameters are read
    without a forward."""
    adapters: Adapters | None = None
    """LoRA's adapters (`peft.enabled`; `model/lora.py`)."""

    def synced_params(self) -> Mapping[str, torch.Tensor]:
        """The weights by global name, any pending all-gather completed (collective); with
        LoRA, each adapted weight merged as it is read (W + s · B A)."""
        self.overlap.sync_params()
        weights = global_named_weights(self.model)
        if self.adapters is None:
            return weights
        return self.adapters.merged(weights, global_named_parameters(self.model))

    @property
    def forward_model(self) -> torch.nn.Module:
        return self.ddp if self.ddp is not None else self.model

    @contextlib.contextmanager
    def reference_swapped_in(self) -> Iterator[None]:
        """The reference weights in the live parameters; the live ones back on exit."""
        assert self.reference is not None
        with self.reference.swapped_into(self.synced_params()):
            yield

    def take_reference(self) -> None:
        """Snapshot the live weights as the reference, unless HF weights gave one already; with
        LoRA the reference is the base (its adapters off: nothing copied)."""
        if self.adapters is not None:
            self.reference = BaseReference(self.adapters)
        elif self.reference is None:
            self.reference = ReferenceWeights(global_named_weights(self.model))


def build_parts(config: PolicyConfig, hf_weights: str | None, *, require_weights: bool) -> Parts:
    """Check the model and layout (before anything is built), then set up the process groups,
    the seeds and the device."""
    hf_config = load_hf_config(config.model_name, require_weights=require_weights)
    shape = model_shape(hf_config)
    check_sliding_window(hf_config, config.max_total_sequence_length)
    check_layout(config.parallel, shape, config.moe, config.recompute)
    check_peft(config.peft, config.parallel, shape)
    if hf_weights is not None:
        field = "model_name" if hf_weights == config.model_name else "weights_path"
        check_hf_folder(hf_weights, hf_config, shape, field=field)
    apply_cpu_patches()
    finalize.install()
    router.install()
    if shape.arch.linear_bias and shape.moe is not None:
        expert_bias.install()
    if shape.latent is not None:
        mla.install(DuplicatedLinear)
    dims, groups = setup_parallel(config.parallel)
    torch.manual_seed(config.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = _DTYPES[config.precision]
    paths = choose_paths(
        device,
        dtype,
        batch_invariant=config.batch_invariant,
        decode_attention=config.generation.decode_attention,
        rotary_dim=shape.rotary_dim,
        rotary_offset=shape.rotary_offset,
        widths_differ=shape.latent is not None and shape.latent.v_dim != shape.head_dim,
        experts=shape.moe is not None,
    )
    return Parts(
        cfg=config,
        hf_config=hf_config,
        shape=shape,
        dims=dims,
        groups=groups,
        device=device,
        dtype=dtype,
        paths=paths,
        rules=BatchRules(config.max_total_sequence_length, shape.vocab_size),
    )


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
        moe=config.moe,
        recompute=config.recompute,
        mlp_chunk_tokens=config.logprob_chunk_size,
        paths=w.paths,
    )
    if hf_weights is not None:
        load_hf_weights(
            global_named_weights(model),
            SafetensorsReader(hf_weights),
            w.shape,
            w.groups,
        )
    adapters = lora.attach(model, config.peft, config.seed) if config.peft.enabled else None
    ddp = optimizer = scheduler = None
    if init_optimizer:
        ddp = wrap_ddp(model, config.optimizer)
        optimizer = build_optimizer(ddp, config.optimizer, params_dtype=w.dtype)
        scheduler = build_scheduler(optimizer, config.optimizer, config.scheduler)
    reference: ReferenceWeights | BaseReference | None = None
    if init_reference and adapters is not None:
        reference = BaseReference(adapters)
    elif init_reference and hf_weights is not None:
        reference = ReferenceWeights(global_named_weights(model))
    return PolicyState(
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        reference=reference,
        overlap=Overlap(ddp),
        adapters=adapters,
    )


def build_services(
    w: Parts, state: PolicyState, *, refit_destination: bool
) -> tuple[Refit, Residency, Checkpointer]:
    """What refits read, memory phases move and checkpoints save: views of `state`."""
    model, ddp, optimizer = state.model, state.ddp, state.optimizer
    weights = RefitWeights(
        state.synced_params,
        w.shape,
        w.groups,
        w.device,
        copy.deepcopy(w.cfg.refit),  # its own: the worker's config is fixed once built
    )
    refit = Refit(weights, destination=refit_destination)
    memory = Residency(
        params=lambda: [*model.parameters(), *model.buffers()],
        grads=lambda: grad_buffers(ddp),
        optimizer=lambda: optimizer_tensors(optimizer),
        device=w.device,
        before_params_move=state.overlap.sync_params,
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
        refit=weights,
    )
    ckpt = w.cfg.checkpoint
    checkpoints = Checkpointer(
        trainee, verify_integrity=ckpt.verify_integrity, writer_threads=ckpt.writer_threads
    )
    return refit, memory, checkpoints


def build_trainer(
    w: Parts, state: PolicyState, plan: MicrobatchPlan, routers: Routers | None
) -> Trainer | None:
    """The optimizer step's owner (None for a worker without an optimizer)."""
    if state.ddp is None:
        return None
    c = w.cfg
    settings = TrainSettings(
        gbs=c.train_global_batch_size,
        mbs=c.train_micro_batch_size,
        logits=logit_options(w),
        max_grad_norm=c.max_grad_norm,
        rules=w.rules,
        router_replay=c.moe.router_replay,
    )
    return Trainer(
        ddp=state.ddp,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
        plan=plan,
        groups=w.groups,
        dp=w.dims.dp,
        device=w.device,
        settings=settings,
        teachers=teacher_heads(w),
        routers=routers,
        overlap=state.overlap,
    )


def teacher_heads(w: Parts) -> TeacherHeads:
    """The (empty) store of teacher LM-head shards, for this rank's vocabulary columns."""
    part = w.shape.padded_vocab_size(w.dims.tp) // w.dims.tp
    start = w.groups.tp_rank * part
    vocab = VocabSlice(
        start=start, cols=max(0, min(part, w.shape.vocab_size - start)),
        vocab_size=w.shape.vocab_size,
    )  # fmt: skip
    return TeacherHeads(
        lifecycle=w.cfg.opd_full_teacher_lm_head_lifecycle, device=w.device, dtype=w.dtype,
        vocab=vocab, last_stage=w.groups.is_last_stage,
    )  # fmt: skip


def build_scorer(
    w: Parts, state: PolicyState, plan: MicrobatchPlan, routers: Routers | None
) -> Scorer:
    return Scorer(
        model=state.forward_model,
        plan=plan,
        groups=w.groups,
        device=w.device,
        logits=logit_options(w),
        rules=w.rules,
        default_mbs=w.cfg.logprob_batch_size,
        routers=routers,
        router_replay=w.cfg.moe.router_replay,
        paths=w.paths,
    )


def build_sampler(
    w: Parts, state: PolicyState, routers: Routers | None, tokenizer: Any | None
) -> Sampler:
    """`generate`'s loop on the forward model; stops at the model's (and tokenizer's) EOS."""
    eos = getattr(w.hf_config, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None:
        eos_ids |= {tokenizer.eos_token_id} - {None}
    d, gen = w.dims, w.cfg.generation
    whole = d.tp == d.pp == d.cp == 1 and routers is None  # one GPU runs the whole model
    decoder = Decoder(
        model=state.forward_model,
        groups=w.groups,
        device=w.device,
        logits=logit_options(w),
        rules=w.rules,
        pad_id=pad_token(w.hf_config, tokenizer),
        routers=routers,
        local=whole,
        graphs=gen.cuda_graphs and w.device.type == "cuda" and whole,
        paths=w.paths,
    )
    return Sampler(
        decoder,
        copy.deepcopy(w.cfg.generation),  # its own: the worker's config is fixed once built
        temperature=w.cfg.temperature,
        eos_ids=tuple(sorted(eos_ids)),
        tokenizer=tokenizer,
        seed=w.cfg.seed,
        sync_params=state.overlap.sync_params,
    )


def build_routers(w: Parts, state: PolicyState) -> Routers | None:
    """An MoE model's routers, each given our extension (`model/routers.py`: replay, the
    balancing loss, token counts, recorded routes); None for a dense model."""
    moe = w.shape.moe
    if moe is None:
        return None
    balance = balance_of(w.cfg.moe.balance, w.cfg.moe.moe_aux_loss_coeff)
    return Routers(
        state.model,
        moe_layers=moe.layers,
        topk=moe.top_k,
        experts=moe.num_experts,
        balance=balance,
        rule=moe.rule,
    )


def logit_options(w: Parts) -> LogitOptions:
    """How this rank reads logits: temperature, its vocabulary slice, `logprob_chunk_size`."""
    return LogitOptions(
        temperature=w.cfg.temperature,
        tp_group=w.groups.tp,
        tp_rank=w.groups.tp_rank,
        vocab_size=w.shape.vocab_size,
        chunk_tokens=w.cfg.logprob_chunk_size,
    )


def micro_batch_plan(w: Parts) -> MicrobatchPlan:
    return build_plan(w.cfg, w.dims, w.groups)


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def shutdown_at_exit(worker: Any) -> None:
    """Call `worker.shutdown()` (idempotent) at interpreter exit too (a script that just
    ends still commits its pending async save, and joins its writer threads while the
    interpreter can still run them). Registered after `setup_parallel`'s hook, so it runs
    before the process groups are destroyed."""
    _register_shutdown_hook()
    _LIVE.add(worker)


@functools.cache
def _register_shutdown_hook() -> None:
    def shutdown_all() -> None:
        for worker in list(_LIVE):
            worker.shutdown()
        finalize_unfinished()  # the saves of workers collected before exit

    atexit.register(shutdown_all)
