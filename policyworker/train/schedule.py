"""Micro-batched forward (and backward) through megatron's pipeline schedules.

`run_microbatches` is where training and every collection (`get_logprobs`, top-k) call
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
from policyworker.losses.common import LossInputs, LossNeeds
from policyworker.model.build import output_head
from policyworker.ops.kl import reverse_kl
from policyworker.ops.logprobs import Head, LogitOptions, logprobs_at
from policyworker.parallel.dims import Groups
from policyworker.train.routing import RouterRun
from policyworker.train.teacher import TeacherHeads

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


def loss_inputs(
    head: Head,
    mb: Microbatch,
    needs: LossNeeds,
    opts: LogitOptions,
    teachers: TeacherHeads | None = None,
) -> LossInputs:
    """What `needs` asks for, from one micro-batch's logits, as [n, S] rows of `mb.data`: one
    chunked pass over the logits picks the next tokens' and the index ids' logprobs together;
    a full-vocabulary KL (against `teachers`' heads for a hidden-state payload) is another."""
    whole = mb.pack(mb.data["input_ids"])  # the whole sequence, [b, T] (or padded [n, S])
    parts = [whole[..., None][..., :0]]  # none: the entropy alone
    if needs.logprobs:
        parts.append(torch.cat([whole[:, 1:], torch.zeros_like(whole[:, :1])], dim=1)[..., None])
    if needs.index_key is not None:
        parts.append(mb.pack(mb.data[needs.index_key]))
    logprobs = at_ids = entropy = kl = None
    if len(parts) > 1 or needs.entropy:
        ids = mb.to_local(torch.cat(parts, dim=-1))
        picked, ent = logprobs_at(head, ids, opts, entropy=needs.entropy)
        picked = mb.gather(picked)  # [b, T, 1 + k] of the whole sequence
        if needs.logprobs:
            # log p(next token) at i, moved to i+1, then to rows; packed, a row's position 0
            # read the previous row's last logits: 0 by definition
            raw = picked[..., 0]
            lp = mb.unpack(torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1))
            logprobs = torch.cat([lp.new_zeros(lp.shape[0], 1), lp[:, 1:]], dim=1)
        if needs.index_key is not None:
            at_ids = mb.unpack(picked[..., int(needs.logprobs) :])
        if ent is not None:
            entropy = mb.unpack(mb.gather(ent))
    if needs.teacher_payload is not None:
        assert teachers is not None
        rows = teachers.rows(mb, needs.teacher_payload, head.hidden.device)
        kl = mb.unpack(mb.gather(reverse_kl(head, rows, opts)))
    return LossInputs(logprobs=logprobs, entropy=entropy, index_logprobs=at_ids, reverse_kl=kl)


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


def sum_over_dp(
    local: dict[str, torch.Tensor], dp_group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """Counts (`global_valid_toks`, ...) summed over the data-parallel ranks."""
    names = sorted(local)
    stacked = torch.stack([local[n].float() for n in names])
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(stacked, group=dp_group)
    return dict(zip(names, stacked.unbind(), strict=True))
