"""megatron-core DDP, optimizer and LR scheduler for a built GPTModel."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    MegatronOptimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.layers import (
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
)
from megatron.core.transformer.module import MegatronModule, param_is_not_shared

from policyworker.config import OptimizerConfig, SchedulerConfig
from policyworker.ops.adamw import AdamWGroup, FusedAdamW
from policyworker.train.grads import FirstTouchDDP


@dataclass(frozen=True)
class _KernelPart:
    """A part `optimizer_step` steps with our one-pass kernel (`ops.adamw`), chosen at build:
    the kernel, and the params whose `main_grad` its grad norm reads (megatron's selection,
    which depends only on the params, made once)."""

    adamw: FusedAdamW
    norm_params: list[torch.nn.Parameter]


_KERNEL: WeakKeyDictionary[MegatronOptimizer, _KernelPart] = WeakKeyDictionary()


def wrap_ddp(model: MegatronModule, cfg: OptimizerConfig) -> FirstTouchDDP:
    """megatron DDP: params and grads (fp32, or the params' dtype: `cfg.grad_reduce_in_fp32`)
    in contiguous buffers, gradients summed over DP
    (reduce-scattered to their owners with the distributed optimizer); the overlapped reduce and
    gather as `cfg` asks (`train.overlap` runs them)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # non-finite grads skip the step instead (see train.step)
    )
    ddp = FirstTouchDDP(config=model.config, ddp_config=ddp_config, module=model)
    # The schedule never reduces gradients: a step may span several schedule calls
    # (split-step training), and `train.step.finish_step` finalizes once, itself.
    model.config.finalize_model_grads_func = None
    model.config.no_sync_func = ddp.no_sync
    model.config.grad_sync_func = None
    return ddp


def build_optimizer(
    ddp: DistributedDataParallel,
    cfg: OptimizerConfig,
    *,
    params_dtype: torch.dtype,
) -> MegatronOptimizer:
    """Adam(W) with fp32 master weights for bf16 params; `optimizer_step` clips and steps it."""
    mcore_cfg = McoreOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        clip_grad=0.0,  # clipping is folded into the Adam kernel by `optimizer_step`
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(mcore_cfg, [ddp])
    _use_fused_adamw(optimizer)
    for part in optimizer_parts(optimizer):
        if _kernel_fits(part):
            _KERNEL[part] = _KernelPart(FusedAdamW(), _norm_params(part))
    return optimizer


def optimizer_parts(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def _use_fused_adamw(optimizer: MegatronOptimizer) -> None:
    """Without TE/apex megatron falls back to torch AdamW (foreach); we switch it to the fused
    kernel (CPU and CUDA), which is faster and takes `grad_scale`, the hook `optimizer_step` uses
    to clip. The flags are read at every step, so switching after construction is enough.
    """
    for part in optimizer_parts(optimizer):
        torch_opt = part.optimizer
        if not isinstance(torch_opt, torch.optim.AdamW):
            raise TypeError(f"expected megatron to build torch AdamW, got {type(torch_opt)}")
        for group in torch_opt.param_groups:
            group["fused"], group["foreach"] = True, False


def _kernel_fits(part: MegatronOptimizer) -> bool:
    """Our kernel steps bf16 models' fp32 masters on the GPU (plain AdamW, masters not sharded:
    the distributed optimizer keeps megatron's own step); elsewhere torch's fused AdamW."""
    if type(part) is not Float16OptimizerWithFloat16Params:
        return False
    params = [p for g in part.float16_groups for p in g]
    plain = not any(g["amsgrad"] or g["maximize"] for g in part.optimizer.param_groups)
    return bool(params) and params[0].is_cuda and plain


def _kernel_groups(part: Float16OptimizerWithFloat16Params) -> list[AdamWGroup]:
    """The part's param groups as the kernel takes them: masters paired with their bf16 model
    weights, and fp32 model params (their own masters) apart; the gradients straight from
    DDP's buffers (`main_grad`, fp32 or bf16: the kernel reads either; megatron's
    `prepare_grads` would copy a bf16 buffer into fp32 `.grad`s, a pass and 4 bytes a
    parameter); Adam's state created as torch's `_init_group` creates it, where a param steps
    for the first time."""
    torch_opt = part.optimizer
    groups = []
    for i, hp in enumerate(torch_opt.param_groups):
        masters, weights = part.fp32_from_float16_groups[i], part.float16_groups[i]
        fp32 = part.fp32_from_fp32_groups[i]
        for params, model in ((masters, weights), (fp32, None)):
            states = [_adam_state(torch_opt, p) for p in params]
            groups.append(
                AdamWGroup(
                    params=params,
                    exp_avgs=[s["exp_avg"] for s in states],
                    exp_avg_sqs=[s["exp_avg_sq"] for s in states],
                    steps=[s["step"] for s in states],
                    grads=[p.main_grad for p in (model if model is not None else params)],
                    model=model,
                    lr=float(hp["lr"]),
                    weight_decay=float(hp["weight_decay"]),
                    betas=(float(hp["betas"][0]), float(hp["betas"][1])),
                    eps=float(hp["eps"]),
                )
            )
    return groups


def _norm_params(part: Float16OptimizerWithFloat16Params) -> list[torch.nn.Parameter]:
    """The model params whose gradients megatron's `get_grads_for_grad_norm` picks (each counted
    once: not a TP duplicate, not a shared copy of the embedding), in its order."""
    weight_of = {
        id(m): w
        for masters, weights in zip(part.fp32_from_float16_groups, part.float16_groups, strict=True)
        for m, w in zip(masters, weights, strict=True)
    }
    return [
        weight_of.get(id(p), p)
        for p in part.get_parameters()
        if param_is_not_shared(p)
        and param_is_not_tensor_parallel_duplicate(p, part.tp_group, part.expert_tp_group)
        and param_is_not_gtp_duplicate(p)
    ]


def _adam_state(torch_opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    state = torch_opt.state[p]
    if not state:  # as torch's fused AdamW starts a param's state
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


@torch.no_grad()
def optimizer_step(
    optimizer: MegatronOptimizer,
    *,
    max_grad_norm: float,
    device: torch.device,
    grad_divisor: torch.Tensor | float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip by the global grad norm and step, reading nothing back to the host: returns
    (applied, grad norm before clipping) as device scalars (bool, fp64), for the caller to read
    after it has queued its other work — the host goes on while the device steps.

    The gradients in the buffers are `grad_divisor` times the true ones (a step normalized after
    the fact, `train.step`): the division is folded into the same `grad_scale` as the clip,
    so it costs no pass over the gradients.

    The phases of megatron's own `step()`, on its optimizer, with torch's multi-tensor ops: without
    TE/apex megatron's helpers loop per tensor (its l2 norm syncs the host once per tensor, its
    clip and master->model copy allocate a temporary per tensor). Here: one multi-tensor norm,
    the clip folded into fused AdamW's `grad_scale` (the kernel divides each gradient as it reads
    it), one multi-tensor master->model copy — or, for a bf16 model on the GPU, our kernel
    (`ops.adamw`: the same Adam, the copy in the same pass). A non-finite norm (NaN or inf in
    any gradient, on any rank of the grad-stats group) applies nothing: `found_inf` skips the
    update on the device (weights, moments and step counts untouched), and the copy writes
    back the unchanged masters.
    """
    parts = optimizer_parts(optimizer)
    for part in parts:
        if part not in _KERNEL:
            part.prepare_grads()  # main params' .grad <- DDP's main_grad (fp32: views, no copy)
    divisor = torch.as_tensor(grad_divisor, dtype=torch.float64, device=device)
    norm = global_grad_norm(parts, device) / divisor
    applied = torch.isfinite(norm)
    clip = (norm + 1.0e-6) / max_grad_norm if max_grad_norm > 0 else torch.ones_like(norm)
    grad_scale = (divisor * clip.clamp_min(1.0)).float()
    found_inf = (~applied).float()
    for part in parts:
        kernel = _KERNEL.get(part)
        if kernel is not None:  # Adam and the bf16 copy in one pass
            kernel.adamw.step(_kernel_groups(part), grad_scale, found_inf)
            continue
        torch_opt = part.optimizer
        # read by Adam.step: fused AdamW divides by grad_scale and skips where found_inf is 1
        torch_opt.grad_scale = grad_scale  # type: ignore[attr-defined]
        torch_opt.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            if isinstance(part, DistributedOptimizer):
                # its step: Adam on this rank's shard, shard -> param buffer, all-gather params
                part.step_with_ready_grads()
            else:
                torch_opt.step()
        finally:
            torch_opt.grad_scale = torch_opt.found_inf = None  # type: ignore[attr-defined]
        if isinstance(part, Float16OptimizerWithFloat16Params):
            model = [p for g in part.float16_groups for p in g]
            main = [p for g in part.fp32_from_float16_groups for p in g]
            torch._foreach_copy_(model, main)
    return applied, norm


def optimizer_tensors(optimizer: MegatronOptimizer | None) -> Iterator[torch.Tensor]:
    """Every tensor the optimizer holds: the params it updates (fp32 masters for a bf16 model)
    and their state (Adam's moments and step)."""
    for part in optimizer_parts(optimizer) if optimizer is not None else []:
        for group in part.optimizer.param_groups:
            yield from group["params"]
        for state in part.optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


def grad_buffers(ddp: DistributedDataParallel | None) -> list[torch.Tensor]:
    """DDP's contiguous fp32 gradient buffers (every `param.main_grad` is a view of one)."""
    if ddp is None:
        return []
    return [b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers]


def optimizer_state_bytes(optimizer: MegatronOptimizer) -> int:
    """Bytes this rank holds for the optimizer: Adam's moments, and the fp32 master weights when
    the model is bf16 (an fp32 model's parameters are its own masters)."""
    total = 0
    for part in optimizer_parts(optimizer):
        state = part.optimizer.state
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                tensors = [t for t in state.get(p, {}).values() if torch.is_tensor(t)]
                total += sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
                if part.config.bf16:
                    total += p.numel() * p.element_size()
    return total


def global_grad_norm(parts: list[MegatronOptimizer], device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients (an fp64 device scalar, not read back), each counted once
    (megatron drops TP duplicates and shared embeddings from `get_grads_for_grad_norm`), summed
    over each part's grad-stats group."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for part in parts:
        kernel = _KERNEL.get(part)
        if kernel is not None:  # read from DDP's buffers, fp32 or bf16
            grads = [p.main_grad for p in kernel.norm_params]
        else:
            grads = part.get_grads_for_grad_norm()
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            sq += torch.stack(torch._foreach_norm(grads, dtype=torch.float32)).square().sum()
        dist.all_reduce(sq, group=part.get_grad_stats_parallel_group())
        total += sq[0]
    return total.double().sqrt()


def build_scheduler(
    optimizer: MegatronOptimizer, opt: OptimizerConfig, sched: SchedulerConfig
) -> OptimizerParamScheduler:
    """One `step(1)` per global batch (a `train()` of several global batches steps it once per
    global batch): warm-up, then constant / linear / cosine to min_lr."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=sched.warmup_init if sched.warmup_steps else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=sched.warmup_steps,
        lr_decay_steps=sched.decay_steps,
        lr_decay_style=sched.style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=sched.decay_steps,
        wd_incr_style="constant",
    )


def restore_schedule(
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    saved: dict,
    opt: OptimizerConfig,
    sched: SchedulerConfig,
) -> list[str]:
    """After a checkpoint's optimizer state is loaded: the schedule exactly as saved — its step
    count and every setting (lr, min_lr, warm-up, decay, weight decay; betas and eps came with
    the optimizer state) — whatever the worker did before. (megatron's own load adds the saved
    step count to the live one and takes weight decay from the live scheduler.)

    Returns "setting: config -> checkpoint" for each setting where the config differs."""
    groups = [g for part in optimizer_parts(optimizer) for g in part.optimizer.param_groups]
    differ = {
        "lr": (opt.lr, saved["max_lr"]),
        "min_lr": (opt.min_lr, saved["min_lr"]),
        "weight_decay": (opt.weight_decay, saved["start_wd"]),
        "warmup_steps": (sched.warmup_steps, saved["lr_warmup_steps"]),
        "decay_steps": (sched.decay_steps, saved["lr_decay_steps"]),
        "style": (sched.style, saved["lr_decay_style"]),
        "betas": (tuple(opt.betas), tuple(groups[0]["betas"]) if groups else tuple(opt.betas)),
        "eps": (opt.eps, groups[0]["eps"] if groups else opt.eps),
    }
    scheduler.max_lr, scheduler.min_lr = saved["max_lr"], saved["min_lr"]
    # not in megatron's saved state: the config's warm-up start, with the checkpoint's warm-up
    scheduler.init_lr = sched.warmup_init if saved["lr_warmup_steps"] else saved["max_lr"]
    scheduler.lr_warmup_steps = saved["lr_warmup_steps"]
    scheduler.lr_decay_steps = saved["lr_decay_steps"]
    scheduler.lr_decay_style = saved["lr_decay_style"]
    scheduler.start_wd, scheduler.end_wd = saved["start_wd"], saved["end_wd"]
    scheduler.wd_incr_steps = saved["wd_incr_steps"]
    scheduler.wd_incr_style = saved["wd_incr_style"]
    for group in groups:
        group["max_lr"], group["min_lr"] = saved["max_lr"], saved["min_lr"]
    scheduler.num_steps = 0
    scheduler.step(increment=int(saved["num_steps"]))
    return [f"{k}: {c!r} -> {s!r}" for k, (c, s) in differ.items() if c != s]
