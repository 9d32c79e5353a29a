"""megatron-core DDP, optimizer and LR scheduler for a built GPTModel."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import MegatronModule

from policyworker.config import OptimizerConfig, SchedulerConfig


def wrap_ddp(model: MegatronModule) -> DistributedDataParallel:
    """megatron DDP: params and fp32 grads in contiguous buffers, gradients summed over DP."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
        check_for_nan_in_grad=False,  # non-finite grads skip the step instead (see train.step)
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    # Our loss is normalized by global token counts already: finalize must not divide by the
    # schedule's token count, only reduce (DP all-reduce, tied embeddings, sequence-parallel norms).
    model.config.finalize_model_grads_func = _finalize_without_token_scaling
    model.config.no_sync_func = ddp.no_sync
    model.config.grad_sync_func = None
    return ddp


def _finalize_without_token_scaling(
    model: list[torch.nn.Module], num_tokens: object, **kwargs: object
) -> None:
    finalize_model_grads(model, num_tokens=None, **kwargs)  # type: ignore[arg-type]


def build_optimizer(
    ddp: DistributedDataParallel,
    cfg: OptimizerConfig,
    *,
    params_dtype: torch.dtype,
    max_grad_norm: float,
) -> MegatronOptimizer:
    """Adam(W) with fp32 master weights for bf16 params; clipping by the global grad norm."""
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
        clip_grad=max_grad_norm,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(mcore_cfg, [ddp])
    if torch.cuda.is_available():
        _use_fused_adamw(optimizer)
    return optimizer


def _use_fused_adamw(optimizer: MegatronOptimizer) -> None:
    """Without TE/apex megatron falls back to torch AdamW (foreach); its fused kernel is faster.

    Both read the per-group flags at every step, so switching after construction is enough.
    """
    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for opt in inner:
        torch_opt = opt.optimizer
        if isinstance(torch_opt, torch.optim.AdamW):
            for group in torch_opt.param_groups:
                group["fused"], group["foreach"] = True, False


def build_scheduler(
    optimizer: MegatronOptimizer, opt: OptimizerConfig, sched: SchedulerConfig
) -> OptimizerParamScheduler:
    """One `step(1)` per train() call: warm-up, then constant / linear / cosine to min_lr."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if sched.warmup_steps else opt.lr,
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


def grads_are_finite(ddp: DistributedDataParallel, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every reduced gradient in DDP's buffers is finite, agreed over `group` (all ranks).

    One fp32 sum per buffer: NaN or inf anywhere makes the sum non-finite. (A sum of finite fp32
    gradients overflows only past ~1e38; such a step is better skipped anyway.)
    """
    sums = torch.stack([b.grad_data.sum() for b in [*ddp.buffers, *ddp.expert_parallel_buffers]])
    bad = (~torch.isfinite(sums)).any().float().reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bool(bad.item() == 0)
