"""MegatronPolicyWorker: the public facade. Thin: it validates, then delegates.

    worker = MegatronPolicyWorker(PolicyConfig(model_name="/ckpt"))
    lp = worker.get_logprobs(data=batch)["logprobs"]                  # [B, S]
    metrics = worker.train(batch, ClippedPGLoss())
    worker.save_hf_pretrained("/out/hf")

Every call checks its input first and raises `ValueError` (a `BatchValidationError` for batches)
before any state changes, so a bad call leaves the worker as it was.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from policyworker.assembly import Parts, build_services, build_state
from policyworker.checkpoint.commit import CheckpointError
from policyworker.checkpoint.hf import save_hf_folder
from policyworker.checkpoint.paths import check_save_paths, initial_weights
from policyworker.compat import apply_cpu_patches
from policyworker.config import PolicyConfig, finite
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import validate_batch
from policyworker.data.microbatch import Microbatch, build_plan
from policyworker.losses.common import Loss, LossNeeds
from policyworker.memory.phases import enter_phase
from policyworker.memory.residency import Where
from policyworker.memory.telemetry import log_memory, memory_stats
from policyworker.model.build import global_named_parameters
from policyworker.model.hf_config import check_sliding_window, load_hf_config, model_shape
from policyworker.model.reference import ReferenceWeights
from policyworker.model.weights import check_hf_folder, export_hf_weights
from policyworker.ops.logprobs import topk_logits
from policyworker.parallel.dims import check_layout, setup_parallel
from policyworker.refit.ipc import RefitReport
from policyworker.refit.layout import RefitInfo
from policyworker.refit.source import check_refit_args
from policyworker.train.lifecycle import (
    OpenStep,
    StepResult,
    StepSpec,
    add_chunk,
    check_batch_sizes,
    finish_step,
    known_counts_for,
    open_step,
    summarize,
    zero_grads,
)
from policyworker.train.optimizer import (
    optimizer_state_bytes,
)
from policyworker.train.step import forward_collect, loss_inputs

log = logging.getLogger(__name__)

_TRAIN_STATE = ("params", "grads", "optimizer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


_LIVE: weakref.WeakSet[MegatronPolicyWorker] = weakref.WeakSet()


def _at_exit(worker: MegatronPolicyWorker) -> None:
    """Shut `worker` down at interpreter exit unless it was before (a script that just ends
    still commits its pending async save, and joins its writer thread while the interpreter
    can still run it). Registered after `setup_parallel`'s hook, so it runs before it."""
    if not _LIVE_HOOK:
        atexit.register(_shutdown_live)
        _LIVE_HOOK.append(True)
    _LIVE.add(worker)


_LIVE_HOOK: list[bool] = []


def _shutdown_live() -> None:
    for worker in list(_LIVE):
        worker.shutdown()


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
        is_refit_destination: bool = False,
    ) -> None:
        self.cfg = config
        self.is_refit_destination = is_refit_destination  # receives reshard refits; never trains
        if is_refit_destination:
            init_optimizer = init_reference_model = False
        self.tokenizer = tokenizer
        hf_weights, checkpoint = initial_weights(
            config.model_name, weights_path, optimizer_path, init_optimizer=init_optimizer
        )
        self.hf_config = load_hf_config(config.model_name, require_weights=weights_path is None)
        self.shape = model_shape(self.hf_config)
        check_sliding_window(self.hf_config, config.max_total_sequence_length)
        check_layout(config.parallel, self.shape)
        if hf_weights is not None:
            field = "model_name" if hf_weights == config.model_name else "weights_path"
            check_hf_folder(hf_weights, self.hf_config, self.shape, field=field)

        apply_cpu_patches()
        self.dims, self.groups = setup_parallel(config.parallel)
        self.plan = build_plan(config, self.dims, self.groups)
        torch.manual_seed(config.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.dtype = _DTYPES[config.precision]
        self.parts = Parts(
            cfg=config,
            hf_config=self.hf_config,
            shape=self.shape,
            dims=self.dims,
            groups=self.groups,
            device=self.device,
            dtype=self.dtype,
        )
        self.state = build_state(
            self.parts,
            hf_weights,
            init_optimizer=init_optimizer,
            init_reference=init_reference_model,
        )
        self._step: OpenStep | None = None
        self.refit, self.memory, self.checkpoints = build_services(self.parts, self.state)
        if checkpoint is not None:
            self.load_checkpoint(checkpoint, optimizer_path)
        if init_reference_model and self.state.reference is None:  # no HF weights: the checkpoint's
            self.state.reference = ReferenceWeights(global_named_parameters(self.state.model))
        self._shut = False
        _at_exit(self)

    def shutdown(self) -> None:
        """Finish what this worker has pending and release what it holds: a pending async save
        is committed (if that fails, its temporary files are removed and a warning names it),
        the refit endpoint's files removed. Collective (the save's commit). Idempotent; runs at
        interpreter exit for every worker not shut down. The process groups, shared by every
        worker of the process, are destroyed at interpreter exit (`parallel.dims`)."""
        if self._shut:
            return
        self._shut = True
        try:
            self.checkpoints.finalize()
        except Exception as e:
            log.warning("shutdown: the pending async save was not committed: %s", e)
        self.refit.close()

    @staticmethod
    def configure_worker(
        num_gpus: int, bundle_indices: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        """A Ray actor hosting this worker: (resources, extra env, extra constructor arguments).
        One rank per actor and bundle: `num_gpus` GPUs and one CPU, whichever the bundle."""
        del bundle_indices
        return {"num_gpus": num_gpus, "num_cpus": 1}, {}, {}

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

        (logprobs,) = self._forward_collect(data, mbs, fn, {"logprobs": torch.float32}, ())
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
        self.memory.require("use_reference_model", "params")
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

        outputs = {"topk_logits": torch.float32, "topk_indices": torch.int64}
        vals, idx = self._forward_collect(data, mbs, fn, outputs, (k,))
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
        Each global batch runs as a split step (begin, one chunk, finish): one implementation.
        """
        self._require_training_state("train")
        self.memory.require("train", *(("params",) if eval_mode else _TRAIN_STATE))
        gbs, mbs = self._step_sizes(gbs, mbs)
        b = self._validate(data, loss_fn.required_keys)
        local_gbs = check_batch_sizes(
            gbs=gbs, mbs=mbs, rows=loss_fn.rows_per_example, dp=self.dims.dp
        )
        if b % local_gbs:
            raise ValueError(
                f"batch size {b}: expected a multiple of the per-rank global batch {local_gbs}"
            )
        self.plan.check(
            data["input_lengths"].tolist(), train=True, rows_per_example=loss_fn.rows_per_example
        )
        data = loss_fn.prepare_batch(data).to(self.device)
        results = []
        for start in range(0, b, local_gbs):
            chunk = data.slice(start, start + local_gbs)
            known = known_counts_for(loss_fn, chunk, self.groups)
            spec = StepSpec(loss_fn, local_gbs, mbs, eval_mode=eval_mode, known_counts=known)
            self._step = open_step(spec)
            self._add_chunk(chunk)
            results.append(self._finish_step())
        return self._summarize(results)

    def begin_train_step(
        self, loss_fn: Loss, gbs: int | None = None, mbs: int | None = None
    ) -> None:
        """Open a step (the gradients are zero). `train_microbatch` then adds chunks of this rank's
        share of the global batch (`gbs / dp` rows in all); `finish_train_step` applies it."""
        self._require_training_state("begin_train_step")
        self.memory.require("begin_train_step", *_TRAIN_STATE)
        gbs, mbs = self._step_sizes(gbs, mbs)
        local_gbs = check_batch_sizes(
            gbs=gbs, mbs=mbs, rows=loss_fn.rows_per_example, dp=self.dims.dp
        )
        self._step = open_step(StepSpec(loss_fn, local_gbs, mbs))

    def train_microbatch(self, data: BatchedDataDict) -> None:
        """Forward/backward a chunk (a multiple of `mbs` rows); gradients accumulate locally, with
        no DP reduce until `finish_train_step`. On an error inside, the step is aborted."""
        step = self._require_open_step("train_microbatch")
        self.memory.require("train_microbatch", "params", "grads")
        spec = step.spec
        b = self._validate(data, spec.loss_fn.required_keys)
        if b % spec.mbs or step.rows + b > spec.local_rows:
            raise ValueError(
                f"data: expected a multiple of mbs={spec.mbs} rows and at most the "
                f"{spec.local_rows - step.rows} rows left of this rank's global batch, got {b}"
            )
        lengths = data["input_lengths"].tolist()
        self.plan.check(lengths, train=True, rows_per_example=spec.loss_fn.rows_per_example)
        self._add_chunk(spec.loss_fn.prepare_batch(data).to(self.device))

    def finish_train_step(self) -> dict[str, Any]:
        """DP-reduce and normalize the gradients, clip, step optimizer and scheduler; metrics."""
        step = self._require_open_step("finish_train_step")
        self.memory.require("finish_train_step", *_TRAIN_STATE)
        if step.rows != step.spec.local_rows:
            raise ValueError(
                f"finish_train_step: the step holds {step.rows} of this rank's "
                f"{step.spec.local_rows} rows (gbs / dp); add the rest or abort_train_step()"
            )
        return self._summarize([self._finish_step()])

    def abort_train_step(self) -> None:
        """Drop the open step: gradients zeroed; weights, optimizer and scheduler untouched."""
        self._require_open_step("abort_train_step")
        self._step = None
        if self.memory.where()["grads"] is Where.DEVICE:
            zero_grads(self.state.ddp, self.state.optimizer)
        else:  # a paused or offloaded step: its gradients are dropped where they are
            self.memory.place({"grads": Where.FREED})

    def set_learning_rate(self, lr: float) -> None:
        """Restart the schedule at a new peak lr (e.g. SFT warm-up, then RL at a smaller lr)."""
        if self.state.scheduler is None:
            raise ValueError("init_optimizer=False: this worker has no optimizer")
        if not (finite(lr) and lr > 0):
            raise ValueError(f"lr: expected a finite number > 0, got {lr!r}")
        self.state.scheduler.max_lr = lr
        for group in self.state.optimizer.param_groups:
            group["max_lr"] = group["lr"] = lr

    # --- memory phases (policyworker.memory.phases has the table) ------------------------------

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Params on the device; optimizer state to the host and idle gradients freed, unless
        `keep_train_buffers` (an open step's gradients always stay)."""
        keep = "(keep_train_buffers)" if keep_train_buffers else ""
        self._phase("prepare_for_lp_inference" + keep)

    def prepare_for_training(self) -> None:
        """Params, gradients and optimizer state on the device."""
        self._phase("prepare_for_training")

    def finish_inference(self) -> None:
        """Params and optimizer state to the host."""
        self._phase("finish_inference")

    def offload_before_refit(self) -> None:
        """Gradients freed (an open step's go to the host), optimizer state to the host; the
        params stay for the refit to read."""
        self._phase("offload_before_refit")

    def offload_after_refit(self) -> None:
        """Everything to the host: the device keeps only the CUDA context."""
        self._phase("offload_after_refit")

    def pause_train_step_with_offloading(self) -> None:
        """Params and optimizer state to the host; an open step's gradients stay on the device
        until `prepare_for_training` resumes it."""
        self._phase("pause_train_step_with_offloading")

    def move_model(
        self, model: torch.nn.Module, device: str, move_params: bool = True, move_grads: bool = True
    ) -> torch.nn.Module:
        """Move the params and/or gradients: "cpu" to the host, "cuda" to the worker's device
        (the CPU itself on a machine without a GPU). Idle gradients are freed, not copied."""
        if model is not self.state.model and model is not self.state.ddp:
            raise ValueError("model: expected this worker's model")
        where = Where.of_device(device)
        targets = {"params": where} if move_params else {}
        if move_grads:
            idle = where is Where.HOST and self._step is None
            targets["grads"] = Where.FREED if idle else where
        self.memory.place(targets)
        return model

    def move_optimizer(self, device: str) -> None:
        """Move the optimizer state (fp32 masters, Adam's moments): "cpu" or "cuda"."""
        self.memory.place({"optimizer": Where.of_device(device)})

    def memory_stats(self) -> dict[str, object]:
        """Allocated, reserved, peak (since the last phase line) and device-used bytes, and
        where the training state is: the numbers of the DEBUG line each phase logs."""
        return memory_stats(self.memory)

    def _phase(self, name: str) -> None:
        enter_phase(self.memory, name, step_open=self._step is not None)
        log_memory(name, self.memory)

    # --- refit (policyworker.refit) ---------------------------------------------------------------

    def prepare_refit_info(self) -> RefitInfo:
        """`{hf_name: (shape, dtype)}` of the whole model, in the order refits send it (all
        pipeline stages, the true vocabulary). Collective over the pipeline the first time."""
        return self.refit.info()

    def get_zmq_address(self) -> str:
        """The ZMQ endpoint this rank's colocated receiver connects to for IPC refits."""
        return self.refit.address

    @property
    def weight_version(self) -> int:
        """Version of the last refit this rank sent (0: none); each refit increments it."""
        return self.refit.version

    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int = 0, refit_timeout_s: float | None = None, send: bool = True
    ) -> RefitReport | None:
        """Refit the receiver at `get_zmq_address()`: straight into its shared staging, or
        through two shared buffers (CUDA IPC on GPU, shared memory on CPU); every weight once,
        applied by the receiver only when complete. Collective over TP/PP; ranks with
        `send=False` only take part in the gathers."""
        check_refit_args(buffer_size_bytes, refit_timeout_s)
        self.memory.require("stream_weights_via_ipc_zmq", "params")
        return self.refit.stream_ipc(
            buffer_size_bytes=buffer_size_bytes, timeout_s=refit_timeout_s, send=send
        )

    def init_collective(
        self, host: str, port: int, world_size: int, refit_timeout_s: float | None = None
    ) -> None:
        """Form the collective refit group with `world_size - 1` receivers (each joins with
        its rank, 1..world_size-1); trainer rank 0 is its rank 0 and hosts the TCP store at
        host:port. Blocks until every member joined (or the timeout)."""
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size: expected an int >= 2, got {world_size!r}")
        self.refit.join_collective(host, port, world_size, refit_timeout_s)

    def broadcast_weights_for_collective(
        self,
        refit_timeout_s: float | None = None,
        buffer_size_bytes: int | None = None,
        num_buffers: int = 2,
    ) -> RefitReport | None:
        """Broadcast every weight to the receivers of `init_collective` (which run
        `update_weights_from_collective`). Collective over TP/PP; trainer rank 0 sends."""
        check_refit_args(buffer_size_bytes or 0, refit_timeout_s, num_buffers)
        self.memory.require("broadcast_weights_for_collective", "params")
        return self.refit.broadcast(
            buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers, timeout_s=refit_timeout_s
        )

    def init_reshard(
        self,
        host: str,
        port: int,
        sources: int,
        destinations: int,
        refit_timeout_s: float | None = None,
    ) -> None:
        """Join the reshard group: every rank of the trainer (`sources` ranks) and of the
        destination workers (`is_refit_destination=True`, `destinations` ranks) calls it with the
        same arguments; trainer rank 0 hosts the store at host:port. Blocks until all joined."""
        self.refit.join_reshard(
            host,
            port,
            sources,
            destinations,
            destination=self.is_refit_destination,
            timeout_s=refit_timeout_s,
        )

    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> RefitReport | int | None:
        """Refit the destination workers of `init_reshard` in their own TP layout: each
        destination rank receives only its shards of the TP-split weights, straight from the
        trainer rank that holds them, and applies them only when the whole refit arrived. Both
        sides call it; trainer rank 0 returns the report, a destination the version it applied."""
        check_refit_args(0, refit_timeout_s)
        self.memory.require("nccl_reshard_refit", "params")
        return self.refit.reshard(destination=self.is_refit_destination, timeout_s=refit_timeout_s)

    # --- checkpoints (policyworker.checkpoint) ---------------------------------------------------

    def save_checkpoint(
        self,
        weights_path: str | Path,
        optimizer_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        async_save: bool | None = None,
    ) -> None:
        """A distributed checkpoint (torch_dist) of the weights at `weights_path` and, with
        `optimizer_path`, of the optimizer, scheduler, RNG and counters. Collective. With
        `async_save` it returns after staging on the host; `finalize_async_save()` (or the next
        save) commits it. Each directory appears, complete, only when committed."""
        self._require_no_open_step("save_checkpoint", needs_optimizer=False)
        paths = check_save_paths(
            weights_path,
            optimizer_path,
            has_optimizer=self.state.optimizer is not None,
            pending=self.checkpoints.pending_targets,
        )
        if paths[1] is not None:
            self._require_training_state("save_checkpoint")
        self.memory.require("save_checkpoint", "params", *(("optimizer",) if paths[1] else ()))
        self.checkpoints.save(
            *paths,
            counters={"step": self._steps_done(), "weight_version": self.refit.version},
            tokenizer=self.tokenizer,
            async_save=self.cfg.checkpoint.async_save if async_save is None else async_save,
        )
        if tokenizer_path is not None and self.tokenizer is not None and dist.get_rank() == 0:
            self.tokenizer.save_pretrained(tokenizer_path)

    def finalize_async_save(self) -> bool:
        """Finish and commit the pending async save (collective); False if there was none."""
        return self.checkpoints.finalize()

    def load_checkpoint(
        self, weights_path: str | Path, optimizer_path: str | Path | None = None
    ) -> None:
        """Load a `save_checkpoint` checkpoint, into any parallel layout; with `optimizer_path`
        also the optimizer, scheduler, counters (and RNG, in the same layout). Collective. A
        missing, incomplete, corrupt or mismatched checkpoint raises `CheckpointError` with the
        worker unchanged."""
        self._require_no_open_step("load_checkpoint", needs_optimizer=optimizer_path is not None)
        self.memory.require("load_checkpoint", *(_TRAIN_STATE if optimizer_path else ("params",)))
        opt = None if optimizer_path is None else Path(optimizer_path)
        manifest = self.checkpoints.load(Path(weights_path), opt)
        self.refit.version = int(manifest["weight_version"])

    def _steps_done(self) -> int:
        return 0 if self.state.scheduler is None else int(self.state.scheduler.num_steps)

    # --- export ----------------------------------------------------------------------------------

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) in the HF layout, for refit or saving: this pipeline stage's tensors,
        full size (TP shards gathered). Collective: every rank of the TP group iterates in step."""
        self.memory.require("export_hf_weights", "params")
        return export_hf_weights(
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

    def _forward_collect(
        self, data: BatchedDataDict, mbs: int, fn: Any, *args: Any
    ) -> list[torch.Tensor]:
        model, device = self.state.forward_model, self.device
        return forward_collect(model, self.plan, self.groups, device, data, mbs, fn, *args)

    # --- helpers ---------------------------------------------------------------------------------

    def _check_inference_call(self, data: BatchedDataDict, micro_batch_size: int | None) -> int:
        """Validate a logprob/top-k call's batch and micro-batch size; returns the latter."""
        self.memory.require("inference", "params")
        mbs = self.cfg.logprob_batch_size if micro_batch_size is None else micro_batch_size
        if not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"micro_batch_size: expected an int >= 1, got {micro_batch_size!r}")
        self._validate(data, ())
        self.plan.check(data["input_lengths"].tolist(), train=False, rows_per_example=1)
        return mbs

    def _validate(self, data: BatchedDataDict, required: tuple[str, ...]) -> int:
        """The batch against the contract (`BatchValidationError`); its size."""
        max_len, vocab = self.cfg.max_total_sequence_length, self.shape.vocab_size
        return validate_batch(data, required=required, max_seq_len=max_len, vocab_size=vocab)[0]

    def _require_no_open_step(self, call: str, needs_optimizer: bool = True) -> None:
        if needs_optimizer and self.state.ddp is None:
            raise ValueError("init_optimizer=False: this worker cannot train")
        if self._step is not None:
            raise ValueError(
                f"{call}: a train step is open; finish_train_step() or abort_train_step() first"
            )

    def _require_training_state(self, call: str) -> None:
        self._require_no_open_step(call)
        if self.checkpoints.damaged is not None:
            raise CheckpointError(
                f"{call}: {self.checkpoints.damaged}; load a checkpoint with its optimizer_path first"
            )

    def _require_open_step(self, call: str) -> OpenStep:
        if self._step is None:
            raise ValueError(f"{call}: no train step is open; begin_train_step() first")
        return self._step

    def _step_sizes(self, gbs: int | None, mbs: int | None) -> tuple[int, int]:
        gbs = self.cfg.train_global_batch_size if gbs is None else gbs
        return gbs, self.cfg.train_micro_batch_size if mbs is None else mbs

    def _add_chunk(self, data: BatchedDataDict) -> None:
        assert self._step is not None
        try:
            add_chunk(
                self._step,
                self.state.ddp,
                data,
                plan=self.plan,
                groups=self.groups,
                temperature=self.cfg.temperature,
                vocab_size=self.shape.vocab_size,
            )
        except BaseException as e:
            self._step = None
            zero_grads(self.state.ddp, self.state.optimizer)
            e.add_note("policyworker: the open train step was aborted (gradients dropped)")
            raise

    def _finish_step(self) -> StepResult:
        step, self._step = self._step, None
        assert step is not None
        try:
            return finish_step(
                step,
                self.state.ddp,
                self.state.optimizer,
                self.state.scheduler,
                groups=self.groups,
                max_grad_norm=self.cfg.max_grad_norm,
                device=self.device,
            )
        except BaseException:
            zero_grads(self.state.ddp, self.state.optimizer)
            raise

    def _summarize(self, results: list[StepResult]) -> dict[str, Any]:
        metrics = summarize(results)
        metrics["optimizer_state_bytes"] = optimizer_state_bytes(self.state.optimizer)
        return metrics
