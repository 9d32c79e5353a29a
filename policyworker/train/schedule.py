"""Micro-batched forward (and backward) through megatron's pipeline schedules.

`run_microbatches` is the one place that calls `get_forward_backward_func()`: inference
(`get_logprobs`, top-k) and training both go through it, so pipeline parallelism slots in
without a second code path. `train.lifecycle` builds an optimizer step on it.
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
from policyworker.model.build import batch_major_logits
from policyworker.ops.logprobs import index_logprobs, vocab_parallel_entropy
from policyworker.parallel.dims import Groups

log = logging.getLogger(__name__)

# (logits [B, S, V/tp] or packed [1, T, V/tp], micro-batch) -> (loss scalar, metrics); the loss
# is ignored when forward-only.
MicrobatchFn = Callable[[torch.Tensor, Microbatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def run_microbatches(
    model: torch.nn.Module,
    microbatches: list[Microbatch],
    fn: MicrobatchFn,
    *,
    forward_only: bool,
) -> list[dict[str, torch.Tensor]]:
    """Run `fn` on each micro-batch's logits via megatron's schedule; returns its metrics dicts."""
    it: Iterator[Microbatch] = iter(microbatches)
    device = microbatches[0].data["input_ids"].device
    moe = get_model_config(model).num_moe_experts is not None

    def forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module) -> Any:
        mb = next(data_iterator)
        ids, pos, packed = mb.model_inputs(device)
        # routers see which tokens are padding (their token counts leave them out)
        extra = {"padding_mask": mb.padding_mask(device)} if moe else {}
        # [B, S, V/tp] (packed: [1, T, V/tp]) on the last stage, hidden states on the others
        logits = model(
            ids, pos, None, packed_seq_params=packed, output_processor=batch_major_logits, **extra
        )

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            loss, metrics = fn(output, mb)
            # 3-tuple form: megatron neither divides by micro-batch count nor token count.
            return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics

        return logits, loss_func

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
    logits: torch.Tensor,
    mb: Microbatch,
    needs: LossNeeds,
    *,
    temperature: float,
    groups: Groups,
    vocab_size: int,
) -> LossInputs:
    """What `needs` asks for, from one micro-batch's logits, as [n, S] rows of `mb.data`.
    `vocab_size` is the true vocabulary: columns past it (TP padding) never count."""
    tp = {
        "temperature": temperature,
        "tp_group": groups.tp,
        "tp_rank": groups.tp_rank,
        "vocab_size": vocab_size,
    }
    logprobs = entropy = at_ids = None
    if needs.logprobs:
        ids = mb.pack(mb.data["input_ids"])  # the whole sequence, [b, T] (or padded [n, S])
        targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # next tokens
        # log p(next token) at every position this rank computed, then the whole sequence
        raw = mb.gather(index_logprobs(logits, mb.to_local(targets)[..., None], **tp)[..., 0])
        lp = mb.unpack(torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1))
        # Packed, a row's position 0 read the previous row's last logits: 0 by definition.
        logprobs = torch.cat([lp.new_zeros(lp.shape[0], 1), lp[:, 1:]], dim=1)
    if needs.entropy:
        entropy = mb.unpack(mb.gather(vocab_parallel_entropy(logits, **tp)))
    if needs.index_key is not None:
        ids = mb.to_local(mb.pack(mb.data[needs.index_key]))
        at_ids = mb.unpack(mb.gather(index_logprobs(logits, ids, **tp)))
    return LossInputs(logprobs=logprobs, entropy=entropy, index_logprobs=at_ids)


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
