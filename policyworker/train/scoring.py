"""Scoring: forward-only passes over a batch — token logprobs (the policy's and, with its weights
swapped in, the reference's), top-k logits, the full payload — assembled per row.

Both run the same pipeline schedule as training (`schedule.run_microbatches`), forward only;
each output is put back in the batch's row order on the CPU, 0 past each row's length, and every
pipeline stage returns it (the last stage computes, then broadcasts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import FULL_PAYLOAD, ROUTES, BatchRules, check_routes
from policyworker.data.microbatch import Microbatch, MicrobatchPlan
from policyworker.losses.common import LossNeeds
from policyworker.losses.distillation import PAYLOAD_KINDS
from policyworker.model.build import set_mode
from policyworker.model.paths import ForwardPaths
from policyworker.model.routers import Routers
from policyworker.ops.logprobs import Head, LogitOptions, full_logits, topk
from policyworker.parallel.dims import Groups, broadcast_from_last_stage
from policyworker.train.loss_inputs import loss_inputs
from policyworker.train.routing import RouterRun
from policyworker.train.schedule import MicrobatchFn, run_microbatches, split_evenly


@dataclass(frozen=True, slots=True, kw_only=True)
class Scorer:
    """What every scoring call runs on: the model, how batches are cut, this rank's groups."""

    model: torch.nn.Module
    plan: MicrobatchPlan
    groups: Groups
    device: torch.device
    logits: LogitOptions
    rules: BatchRules
    """The context and vocabulary every batch meets."""
    default_mbs: int
    paths: ForwardPaths
    """The model's phases: collections run the scoring one (`model/paths.py`)."""
    routers: Routers | None = None
    """An MoE model's routers (replay and record); None for a dense model."""
    router_replay: bool = False
    """`moe.router_replay`: `get_logprobs` replays a batch's routes unless told not to."""

    # The worker's calls (`interface.PolicyCalls` documents them): check, then collect.

    def get_logprobs(
        self,
        *,
        data: BatchedDataDict,
        micro_batch_size: int | None,
        require_router_replay: bool,
        return_routes: bool,
    ) -> BatchedDataDict:
        replay = require_router_replay and self.router_replay
        mbs = self.check(data, micro_batch_size, replay=replay, record=return_routes)
        return self.logprobs(data, mbs, replay=replay, record=return_routes)

    def get_topk_logits(
        self, *, data: BatchedDataDict, k: int, micro_batch_size: int | None
    ) -> BatchedDataDict:
        vals, idx = self.topk(data, self.check(data, micro_batch_size, k), k)
        return BatchedDataDict({"topk_logits": vals, "topk_indices": idx})

    def get_logprobs_with_full_payload(
        self,
        *,
        data: BatchedDataDict,
        payload: str,
        payload_dtype: str,
        micro_batch_size: int | None,
    ) -> BatchedDataDict:
        mbs = self.check(data, micro_batch_size)
        return self.full_payload(data, mbs, payload=payload, payload_dtype=payload_dtype)

    def check(
        self,
        data: BatchedDataDict,
        micro_batch_size: int | None,
        k: int = 1,
        *,
        replay: bool = False,
        record: bool = False,
    ) -> int:
        """Validate a collection's batch (`BatchValidationError`), micro-batch size and top-k,
        and what its routers do (replay: the batch's `routed_experts`; record: an MoE model);
        returns the micro-batch size."""
        vocab = self.rules.vocab_size
        if not isinstance(k, int) or not 1 <= k <= vocab:
            raise ValueError(f"k: expected an int in [1, {vocab}], got {k!r}")
        mbs = self.default_mbs if micro_batch_size is None else micro_batch_size
        if not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"micro_batch_size: expected an int >= 1, got {micro_batch_size!r}")
        if record and self.routers is None:
            raise ValueError("return_routes: the model has no experts (no routes to return)")
        required = (ROUTES,) if replay else ()
        self.rules.check(data, required)
        if replay:
            assert self.routers is not None
            r = self.routers
            check_routes(data, layers=r.num_layers, topk=r.topk, experts=r.experts)
        self.plan.check(data["input_lengths"].tolist(), train=False, rows_per_example=1)
        return mbs

    def logprobs(
        self, data: BatchedDataDict, mbs: int, *, replay: bool = False, record: bool = False
    ) -> BatchedDataDict:
        """`logprobs` [B, S] fp32: log p(token_i | tokens_<i) at i, 0 at 0 and past the length;
        with `record` (an MoE model) `routed_experts`, the routes used [B, S, L, K] (-1 past the
        length). `replay`: the routers take the batch's `routed_experts`."""
        needs = LossNeeds(logprobs=True)

        def fn(head: Head, mb: Microbatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp = loss_inputs(head, mb, needs, self.logits).logprobs
            assert lp is not None
            return lp.new_zeros(()), {"logprobs": lp}

        routing = None
        if self.routers is not None:
            routing = RouterRun(routers=self.routers, replay=replay, record=record)
        logprobs, *routes = self.collect(
            data, mbs, fn, outputs={"logprobs": torch.float32}, routing=routing
        )
        return BatchedDataDict({"logprobs": logprobs, **({ROUTES: routes[0]} if routes else {})})

    def full_payload(
        self, data: BatchedDataDict, mbs: int, *, payload: str, payload_dtype: str
    ) -> BatchedDataDict:
        """`logprobs` [B, S] on every stage and `teacher_full_payload` [B, S, D] on CPU on the
        last pipeline stage (None elsewhere; never broadcast): the final hidden states (after
        the final norm, D = hidden size) or the whole vocabulary's logits (D = V, gathered over
        TP, no temperature), from one forward; each micro-batch's moves to CPU at once, CP and
        packing undone. The seed's `get_logprobs_with_full_payload`."""
        dtype = payload_type(payload, payload_dtype)
        needs = LossNeeds(logprobs=True)

        def fn(head: Head, mb: Microbatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp = loss_inputs(head, mb, needs, self.logits).logprobs
            assert lp is not None
            x = head.hidden if payload == "hidden_states" else full_logits(head, self.logits)
            rows = mb.unpack(mb.gather(x.to(dtype))).cpu()
            return lp.new_zeros(()), {"logprobs": lp, PAYLOAD: rows}

        outputs = {"logprobs": torch.float32, PAYLOAD: dtype}
        logprobs, full = self.collect(data, mbs, fn, outputs=outputs, last_stage_only=(PAYLOAD,))
        return BatchedDataDict({"logprobs": logprobs, PAYLOAD: full})

    def topk(self, data: BatchedDataDict, mbs: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, k] logits / temperature and their vocabulary ids, largest first."""

        def fn(head: Head, mb: Microbatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            vals, idx = topk(head, k, self.logits)
            vals, idx = mb.unpack(mb.gather(vals)), mb.unpack(mb.gather(idx))
            return vals.new_zeros(()), {"topk_logits": vals, "topk_indices": idx}

        outputs = {"topk_logits": torch.float32, "topk_indices": torch.int64}
        vals, idx = self.collect(data, mbs, fn, outputs=outputs, trailing=(k,))
        return vals, idx

    def collect(
        self,
        data: BatchedDataDict,
        mbs: int,
        fn: MicrobatchFn,
        *,
        outputs: dict[str, torch.dtype],
        trailing: tuple[int, ...] = (),
        routing: RouterRun | None = None,
        last_stage_only: tuple[str, ...] = (),
    ) -> list[torch.Tensor]:
        """Forward-only over micro-batches; each of `outputs` (per-row tensors that `fn`
        returns as metrics) assembled on CPU as [B, S, *trailing], 0 past each length, on every
        pipeline stage — but `last_stage_only` ones (their own trailing shape) only on the last
        (None on the others); then, if `routing` records, the routes used [B, S, L, K]."""
        set_mode(self.model, training=False)
        names = ["input_ids", "input_lengths"] + ([ROUTES] if routing and routing.replay else [])
        batch = BatchedDataDict({k: data[k] for k in names}).to(self.device)
        if self.groups.ep_size > 1:  # every forward exchanges tokens with the other EP ranks
            microbatches = split_evenly(batch, self.plan, mbs, 1, self.groups, train=False)
        else:
            microbatches = self.plan.split(batch, train=False, mbs=mbs)
        with torch.no_grad(), self.paths.scoring():
            stores = run_microbatches(
                self.model, microbatches, fn, forward_only=True, routing=routing
            )
        b, s = data["input_ids"].shape
        result = []
        for key, dtype in outputs.items():
            parts = [st[key] for st in stores]  # stores: last stage only
            if key in last_stage_only:
                shape = (b, s, *parts[0].shape[2:]) if parts else None
                out = (
                    None
                    if shape is None
                    else _rows(microbatches, parts, data["input_lengths"], shape, dtype, 0)
                )
                result.append(out)
                continue
            out = _rows(microbatches, parts, data["input_lengths"], (b, s, *trailing), dtype, 0)
            result.append(broadcast_from_last_stage(out, self.groups, device=self.device))
        if routing is not None and routing.record:
            result.append(self._routes(microbatches, data, routing))
        return result

    def _routes(
        self, microbatches: list[Microbatch], data: BatchedDataDict, routing: RouterRun
    ) -> torch.Tensor:
        """The recorded routes, [B, S, L, K] on CPU: each pipeline stage's MoE layers merged
        (-1 elsewhere), -1 past each length."""
        b, s = data["input_ids"].shape
        shape = (b, s, routing.routers.num_layers, routing.routers.topk)
        lengths = data["input_lengths"]
        out = _rows(microbatches, routing.recorded, lengths, shape, torch.int64, -1)
        if self.groups.pp is not None and dist.get_world_size(self.groups.pp) > 1:
            merged = out.to(self.device)
            dist.all_reduce(merged, op=dist.ReduceOp.MAX, group=self.groups.pp)
            out = merged.cpu()
        return out


PAYLOAD = FULL_PAYLOAD
PAYLOADS = PAYLOAD_KINDS


_PAYLOAD_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def payload_type(payload: str, payload_dtype: str) -> torch.dtype:
    """A full payload's kind and dtype name, checked (`ValueError` naming the argument)."""
    if payload not in PAYLOADS:
        raise ValueError(f"payload: expected one of {PAYLOADS}, got {payload!r}")
    if payload_dtype not in _PAYLOAD_DTYPES:
        raise ValueError(
            f"payload_dtype: expected one of {sorted(_PAYLOAD_DTYPES)}, got {payload_dtype!r}"
        )
    return _PAYLOAD_DTYPES[payload_dtype]


def _rows(
    microbatches: list[Microbatch],
    parts: list[torch.Tensor],
    lengths: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    fill: float,
) -> torch.Tensor:
    """Per-micro-batch [n, S', ...] results in the batch's row order on CPU ([B, S, ...] can be
    large), `fill` past each row's length. S' may exceed S: a micro-batch is its longest row
    rounded up to a multiple of TP under sequence parallelism (positions past every length)."""
    out = torch.full(shape, fill, dtype=dtype)
    b, s = shape[:2]
    for mb, part in zip(microbatches, parts, strict=False):
        part = part[:, :s].cpu()
        for i, row in enumerate(mb.rows):  # row copies: CPU advanced indexing is slow
            out[row, : part.shape[1]] = part[i]
    valid = torch.arange(s)[None, :] < lengths.cpu()[:, None]  # [B, S]
    return out.masked_fill_(~valid.reshape(b, s, *[1] * (len(shape) - 2)), fill)
