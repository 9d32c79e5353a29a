"""MegatronPolicyWorker: the public facade. Thin: it validates, then delegates.

    worker = MegatronPolicyWorker(PolicyConfig(model_name="/ckpt"))
    lp = worker.get_logprobs(data=batch)["logprobs"]                  # [B, S]
    metrics = worker.train(batch, ClippedPGLoss())
    worker.save_hf_pretrained("/out/hf")

Every call checks its input first and raises `ValueError` (a `BatchValidationError` for batches)
before any state changes, so a bad call leaves the worker as it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from policyworker.checkpoint.hf import save_hf_folder
from policyworker.compat import apply_cpu_patches
from policyworker.config import PolicyConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import validate_batch
from policyworker.data.microbatch import Microbatch, build_plan
from policyworker.losses.common import Loss, LossNeeds
from policyworker.model.build import build_gpt_model, global_named_parameters
from policyworker.model.hf_config import check_sliding_window, load_hf_config, model_shape
from policyworker.model.reference import ReferenceWeights
from policyworker.model.weights import SafetensorsReader, export_hf_weights, load_hf_weights
from policyworker.ops.logprobs import topk_logits
from policyworker.parallel.dims import (
    Groups,
    ParallelDims,
    broadcast_from_last_stage,
    check_layout,
    init_distributed,
    init_model_parallel,
)
from policyworker.train.optimizer import (
    build_optimizer,
    build_scheduler,
    optimizer_state_bytes,
    wrap_ddp,
)
from policyworker.train.step import loss_inputs, run_microbatches, train_global_batch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


class MegatronPolicyWorker:
    """One rank's policy: logprobs, top-k, training and HF export on a megatron-core GPTModel."""

    def __init__(
        self,
        config: PolicyConfig,
        tokenizer: Any | None = None,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
    ) -> None:
        if optimizer_path is not None:
            raise ValueError(
                "optimizer_path: optimizer state loading comes with distributed checkpoints"
            )
        self.cfg = config
        self.tokenizer = tokenizer
        self.hf_config = load_hf_config(config.model_name, require_weights=weights_path is None)
        self.shape = model_shape(self.hf_config)
        check_sliding_window(self.hf_config, config.max_total_sequence_length)
        check_layout(config.parallel, self.shape)
        reader = SafetensorsReader(weights_path or config.model_name)

        apply_cpu_patches()
        init_distributed()
        p = config.parallel
        self.dims = ParallelDims.from_world(
            world_size=dist.get_world_size(),
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            cp=p.context_parallel_size,
            ep=p.expert_model_parallel_size,
            sp=p.sequence_parallel,
        )
        init_model_parallel(self.dims)
        self.groups = Groups.current()
        self.plan = build_plan(config, self.dims, self.groups)
        torch.manual_seed(config.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )

        self.dtype = _DTYPES[config.precision]
        model = build_gpt_model(
            self.hf_config,
            self.shape,
            dims=self.dims,
            params_dtype=self.dtype,
            max_seq_len=config.max_total_sequence_length,
            pre_process=self.groups.is_first_stage,
            post_process=self.groups.is_last_stage,
        )
        load_hf_weights(
            global_named_parameters(model),
            reader,
            self.shape,
            tp_rank=self.groups.tp_rank,
            tp_size=self.dims.tp,
        )
        ddp = optimizer = scheduler = None
        if init_optimizer:
            ddp = wrap_ddp(model, distributed_optimizer=config.optimizer.use_distributed_optimizer)
            optimizer = build_optimizer(ddp, config.optimizer, params_dtype=self.dtype)
            scheduler = build_scheduler(optimizer, config.optimizer, config.scheduler)
        reference = (
            ReferenceWeights(global_named_parameters(model)) if init_reference_model else None
        )
        self.state = PolicyState(
            model=model, ddp=ddp, optimizer=optimizer, scheduler=scheduler, reference=reference
        )

    # --- inference -------------------------------------------------------------------------------

    def get_logprobs(
        self, *, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """`{"logprobs": [B, S]}` fp32: log p(token_i | tokens_<i) at i, 0 at 0 and past the length."""
        mbs = self._check_inference_call(data, micro_batch_size)
        needs = LossNeeds(logprobs=True)

        def fn(
            logits: torch.Tensor, mb: Microbatch
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp = loss_inputs(
                logits,
                mb,
                needs,
                temperature=self.cfg.temperature,
                groups=self.groups,
                vocab_size=self.shape.vocab_size,
            ).logprobs
            assert lp is not None
            return lp.new_zeros(()), {"logprobs": lp}

        (logprobs,) = self._forward_collect(
            data, mbs, fn, outputs={"logprobs": torch.float32}, trailing=()
        )
        return BatchedDataDict({"logprobs": logprobs})

    def get_reference_policy_logprobs(
        self, *, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """`{"reference_logprobs": [B, S]}`: `get_logprobs` under the reference weights."""
        with self.use_reference_model():
            out = self.get_logprobs(data=data, micro_batch_size=micro_batch_size)
        return BatchedDataDict({"reference_logprobs": out["logprobs"]})

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Swap the reference weights into the live parameters; the live ones return on exit."""
        if self.state.reference is None:
            raise ValueError("init_reference_model=False: this worker holds no reference model")
        with self.state.reference.swapped_into(global_named_parameters(self.state.model)):
            yield

    def get_topk_logits(
        self, *, data: BatchedDataDict, k: int, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """`{"topk_logits", "topk_indices"}` [B, S, k] of logits / temperature at each position."""
        if not isinstance(k, int) or not 1 <= k <= self.shape.vocab_size:
            raise ValueError(f"k: expected an int in [1, {self.shape.vocab_size}], got {k!r}")
        mbs = self._check_inference_call(data, micro_batch_size)

        def fn(
            logits: torch.Tensor, mb: Microbatch
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            vals, idx = topk_logits(
                logits,
                k,
                temperature=self.cfg.temperature,
                tp_group=self.groups.tp,
                tp_rank=self.groups.tp_rank,
                vocab_size=self.shape.vocab_size,
            )
            vals, idx = mb.unpack(mb.gather(vals)), mb.unpack(mb.gather(idx))
            return vals.new_zeros(()), {"topk_logits": vals, "topk_indices": idx}

        vals, idx = self._forward_collect(
            data,
            mbs,
            fn,
            outputs={"topk_logits": torch.float32, "topk_indices": torch.int64},
            trailing=(k,),
        )
        return BatchedDataDict({"topk_logits": vals, "topk_indices": idx})

    # --- training --------------------------------------------------------------------------------

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Loss,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """One optimizer step per global batch of `data`; returns the metrics (see README).

        `eval_mode=True` computes the same loss and touches no weight, optimizer or scheduler state.
        """
        if self.state.ddp is None:
            raise ValueError("init_optimizer=False: this worker cannot train")
        gbs = self.cfg.train_global_batch_size if gbs is None else gbs
        mbs = self.cfg.train_micro_batch_size if mbs is None else mbs
        b, _ = validate_batch(
            data,
            required=loss_fn.required_keys,
            max_seq_len=self.cfg.max_total_sequence_length,
            vocab_size=self.shape.vocab_size,
        )
        local_gbs = self._check_batch_sizes(b=b, gbs=gbs, mbs=mbs, rows=loss_fn.rows_per_example)
        self.plan.check(
            data["input_lengths"].tolist(), train=True, rows_per_example=loss_fn.rows_per_example
        )
        data = loss_fn.prepare_batch(data).to(self.device)
        ddp = self.state.ddp
        ddp.train()
        results = []
        for start in range(0, b, local_gbs):
            results.append(
                train_global_batch(
                    ddp=ddp,
                    optimizer=self.state.optimizer,
                    scheduler=self.state.scheduler,
                    batch=data.slice(start, start + local_gbs),
                    loss_fn=loss_fn,
                    plan=self.plan,
                    micro_batch_size=mbs,
                    temperature=self.cfg.temperature,
                    vocab_size=self.shape.vocab_size,
                    max_grad_norm=self.cfg.max_grad_norm,
                    groups=self.groups,
                    eval_mode=eval_mode,
                )
            )
        metrics = _summarize(results)
        metrics["optimizer_state_bytes"] = optimizer_state_bytes(self.state.optimizer)
        return metrics

    def set_learning_rate(self, lr: float) -> None:
        """Restart the schedule at a new peak lr (e.g. SFT warm-up, then RL at a smaller lr)."""
        if self.state.scheduler is None:
            raise ValueError("init_optimizer=False: this worker has no optimizer")
        if not lr > 0:
            raise ValueError(f"lr: expected > 0, got {lr!r}")
        self.state.scheduler.max_lr = lr
        for group in self.state.optimizer.param_groups:
            group["max_lr"] = group["lr"] = lr

    # --- export ----------------------------------------------------------------------------------

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) in the HF layout, for refit or saving: this pipeline stage's tensors,
        full size (TP shards gathered). Collective: every rank of the TP group iterates in step."""
        yield from export_hf_weights(
            global_named_parameters(self.state.model), self.shape, tp_group=self.groups.tp
        )

    def save_hf_pretrained(self, folder: str | Path) -> Path:
        """A Hugging Face folder (config, safetensors, tokenizer if given) of the live weights.

        Collective: every rank calls it; one rank per pipeline stage writes that stage's tensors.
        """
        return save_hf_folder(
            folder,
            hf_config=self.hf_config,
            tensors=self.export_hf_weights(),
            tokenizer=self.tokenizer,
            writer=self.groups.tp_rank == 0
            and self.groups.dp_rank == 0
            and self.groups.cp_rank == 0,
            part=self.groups.pp_rank,
        )

    # --- helpers ---------------------------------------------------------------------------------

    def _check_inference_call(self, data: BatchedDataDict, micro_batch_size: int | None) -> int:
        """Validate a logprob/top-k call's batch and micro-batch size; returns the latter."""
        mbs = self.cfg.logprob_batch_size if micro_batch_size is None else micro_batch_size
        if not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"micro_batch_size: expected an int >= 1, got {micro_batch_size!r}")
        validate_batch(
            data,
            required=(),
            max_seq_len=self.cfg.max_total_sequence_length,
            vocab_size=self.shape.vocab_size,
        )
        self.plan.check(data["input_lengths"].tolist(), train=False, rows_per_example=1)
        return mbs

    def _check_batch_sizes(self, *, b: int, gbs: int, mbs: int, rows: int) -> int:
        dp = self.dims.dp
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
        local_gbs = gbs // dp
        if b % local_gbs:
            raise ValueError(
                f"batch size {b}: expected a multiple of the per-rank global batch {local_gbs}"
            )
        return local_gbs

    def _forward_collect(
        self,
        data: BatchedDataDict,
        mbs: int,
        fn: Any,
        *,
        outputs: dict[str, torch.dtype],
        trailing: tuple[int, ...],
    ) -> list[torch.Tensor]:
        """Forward-only over micro-batches; each of `outputs` padded back to [B, S, *trailing].

        Only the last pipeline stage computes them; every stage returns them (broadcast).
        """
        model = self.state.forward_model
        model.eval()
        batch = BatchedDataDict({k: data[k] for k in ("input_ids", "input_lengths")}).to(
            self.device
        )
        microbatches = self.plan.split(batch, train=False, mbs=mbs)
        with torch.no_grad():
            stores = run_microbatches(model, microbatches, fn, forward_only=True)
        b, s = data["input_ids"].shape
        valid = torch.arange(s)[None, :] < data["input_lengths"].cpu()[:, None]  # [B, S]
        result = []
        for key, dtype in outputs.items():
            out = torch.zeros((b, s, *trailing), dtype=dtype)  # on CPU: [B, S, k] can be large
            for mb, st in zip(microbatches, stores, strict=False):  # stores: last stage only
                part = st[key].cpu()
                out[mb.rows, : part.shape[1]] = part
            out[~valid] = 0
            result.append(broadcast_from_last_stage(out, self.groups, device=self.device))
        return result


def _summarize(results: list[Any]) -> dict[str, Any]:
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
    return out
