"""MegatronPolicyWorker, the public facade: it validates (`guard.Guard`), then delegates to
`train.Trainer`, `train.Scorer`, `refit.Refit` (a source per transport), `memory.Residency` and
`checkpoint.Checkpointer` (put together by `assembly`). A bad call raises `ValueError` before any
state changes.

    worker = MegatronPolicyWorker(PolicyConfig(model_name="/ckpt"))
    lp = worker.get_logprobs(data=batch)["logprobs"]                  # [B, S]
    metrics = worker.train(batch, ClippedPGLoss())
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from policyworker.checkpoint.hf import save_hf_folder
from policyworker.checkpoint.paths import check_save_paths, initial_weights
from policyworker.config import PolicyConfig, as_policy_config, teacher_path
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.guard import Guard
from policyworker.logs import quiet_third_party
from policyworker.losses.common import Loss
from policyworker.memory.phases import TRAIN_BUFFERS_KEPT, MemoryPhase, enter_phase
from policyworker.memory.residency import GROUPS, Where
from policyworker.memory.telemetry import memory_stats
from policyworker.model.report import tensor_parallel_report
from policyworker.refit.layout import RefitInfo, RefitReport
from policyworker.refit.sparse import SparseCall


def _phase_call(phase: MemoryPhase, doc: str) -> Any:
    """A worker call that enters `phase` (`memory/phases.py` has the table), declared in one line."""

    def call(self: MegatronPolicyWorker) -> None:
        self._phase(phase)

    call.__name__, call.__qualname__ = str(phase), f"MegatronPolicyWorker.{phase}"
    call.__doc__ = doc
    return call


class MegatronPolicyWorker:
    """One rank's policy: logprobs, top-k, training and HF export on a megatron-core GPTModel."""

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        tokenizer: Any | None = None,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        is_refit_destination: bool = False,
    ) -> None:
        quiet_third_party()  # before megatron-core's first import: its notices are not ours
        from policyworker import assembly  # megatron-core loads here: the driver imports this too

        config = as_policy_config(config)  # NeMo-RL passes its configs as dicts
        self.cfg, self.tokenizer = config, tokenizer
        self.is_refit_destination = is_refit_destination  # receives reshard refits; never trains
        if is_refit_destination:
            init_optimizer = init_reference_model = False
        hf_weights, checkpoint = initial_weights(
            config.model_name, weights_path, optimizer_path, init_optimizer=init_optimizer
        )
        parts = assembly.build_parts(config, hf_weights, require_weights=weights_path is None)
        self.hf_config, self.shape, self.device = parts.hf_config, parts.shape, parts.device
        self.dims, self.groups = parts.dims, parts.groups
        self.plan = assembly.micro_batch_plan(parts)
        self.state = assembly.build_state(
            parts, hf_weights, init_optimizer=init_optimizer, init_reference=init_reference_model
        )
        routers = assembly.build_routers(parts, self.state)
        self.trainer = assembly.build_trainer(parts, self.state, self.plan, routers)
        self.scorer = assembly.build_scorer(parts, self.state, self.plan, routers)
        self.sampler = assembly.build_sampler(parts, self.state, routers, tokenizer)
        self.refit, self.memory, self.checkpoints = assembly.build_services(
            parts, self.state, refit_destination=is_refit_destination
        )
        self.guard = Guard(config, self.memory, self.checkpoints, self.trainer)
        if checkpoint is not None:
            self.load_checkpoint(checkpoint, optimizer_path)
        if init_reference_model:  # after the checkpoint's weights are in
            self.state.take_reference()
        assembly.shutdown_at_exit(self)

    def shutdown(self) -> None:
        """Commit a pending async save (a failed one is removed, with a warning), remove the
        refit endpoint's files. Collective; idempotent; also run at interpreter exit."""
        self.checkpoints.close()
        self.refit.close()

    @staticmethod
    def configure_worker(
        num_gpus: int, bundle_indices: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        """A Ray actor's (resources, extra env, extra constructor arguments): one rank each."""
        del bundle_indices
        return {"num_gpus": num_gpus, "num_cpus": 1}, {}, {}

    # --- inference -------------------------------------------------------------------------------

    def get_logprobs(
        self,
        *,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        require_router_replay: bool = True,
        return_routes: bool = False,
    ) -> BatchedDataDict:
        """`{"logprobs": [B, S]}` fp32: log p(token_i | tokens_<i) at i; 0 at 0 and past the end
        (+ the routes used, `routed_experts`); `moe.router_replay`: replays the batch's routes."""
        self.guard.require("get_logprobs", "params")
        replay = require_router_replay and self.cfg.moe.router_replay
        mbs = self.scorer.check(data, micro_batch_size, replay=replay, record=return_routes)
        return self.scorer.logprobs(data, mbs, replay=replay, record=return_routes)

    def get_reference_policy_logprobs(
        self, *, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """`{"reference_logprobs": [B, S]}`: `get_logprobs` under the reference weights."""
        with self.use_reference_model():  # its routers choose (no replay, as NeMo-RL)
            out = self.get_logprobs(
                data=data, micro_batch_size=micro_batch_size, require_router_replay=False
            )
        return BatchedDataDict({"reference_logprobs": out["logprobs"]})

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Swap the reference weights into the live parameters; the live ones return on exit."""
        if self.state.reference is None:
            raise ValueError("init_reference_model=False: this worker holds no reference model")
        self.guard.require("use_reference_model", "params")
        with self.state.reference_swapped_in():
            yield

    def get_topk_logits(
        self, *, data: BatchedDataDict, k: int, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """`{"topk_logits", "topk_indices"}` [B, S, k] of logits / temperature at each position."""
        self.guard.require("get_topk_logits", "params")
        vals, idx = self.scorer.topk(data, self.scorer.check(data, micro_batch_size, k), k)
        return BatchedDataDict({"topk_logits": vals, "topk_indices": idx})

    def get_logprobs_with_full_payload(
        self,
        *,
        data: BatchedDataDict,
        payload: str,
        payload_dtype: str,
        micro_batch_size: int | None = None,
    ) -> BatchedDataDict:
        """`logprobs` [B, S] and, on the last stage, `teacher_full_payload` [B, S, D] on CPU."""
        self.guard.require("get_logprobs_with_full_payload", "params")
        mbs = self.scorer.check(data, micro_batch_size)
        return self.scorer.full_payload(data, mbs, payload=payload, payload_dtype=payload_dtype)

    def generate(
        self, *, data: BatchedDataDict, greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict:
        """Sample responses with this model (`cfg.generation`, a KV cache, no refit): the
        reference's generation keys; their `logprobs` are `get_logprobs`' (ops/sampling.py)."""
        self.guard.require("generate", "params")
        stops = self.sampler.check(data, seed)
        self.state.overlap.sync_params()  # whole parameters, not a step's pending shards
        return self.sampler.generate(data, stops, greedy=greedy, seed=seed)

    def calibrate_qkv_fp8_scales(
        self,
        *,
        data: BatchedDataDict,
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
        save_path: str | Path | None = None,
    ) -> dict[str, Any]:
        """FP8 KV-cache scales of Q/K/V from `data` (the seed's; model/calibration.py)."""
        self.guard.require("calibrate_qkv_fp8_scales", "params")
        from policyworker.train.calibration import calibrate

        mbs = self.scorer.check(data, micro_batch_size)
        return calibrate(
            self.scorer,
            self.state.model,
            data,
            mbs,
            percentile=percentile,
            margin=margin,
            include_q=include_q,
            save_path=save_path,
        )

    # --- training (policyworker.train.Trainer) ---------------------------------------------------

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Loss,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        check_dim_skip_keys: Iterable[str] | None = None,
    ) -> dict[str, Any]:
        """An optimizer step per global batch (none if `eval_mode`); `check_dim_skip_keys`: None."""
        if check_dim_skip_keys is not None:
            raise ValueError("check_dim_skip_keys: expected None (no cross-tokenizer fields here)")
        trainer = self.guard.trainer("train", *(("params",) if eval_mode else GROUPS))
        trainer.check_batch(data, loss_fn)
        return trainer.train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)

    def load_opd_full_teacher_lm_head(self, teacher_path_config: Any, teacher_index: int) -> str:
        """This rank's shard of a teacher's LM head, for `FullDistillationLoss` on hidden-state
        payloads (`opd_full_teacher_lm_head_lifecycle`); returns the teacher's folder."""
        path = teacher_path(teacher_path_config)
        self.guard.trainer("load_opd_full_teacher_lm_head", step_open=None).teachers.load(
            path, teacher_index
        )
        return path

    def begin_train_step(
        self, loss_fn: Loss, gbs: int | None = None, mbs: int | None = None
    ) -> None:
        """Open a step (zero gradients) for `train_microbatch`; `finish_train_step` applies it."""
        self.guard.trainer("begin_train_step", *GROUPS).begin(loss_fn, gbs, mbs)

    def train_microbatch(self, data: BatchedDataDict) -> None:
        """Forward/backward `mbs`-row multiples (no DP reduce yet); an error aborts the step."""
        trainer = self.guard.trainer("train_microbatch", "params", "grads", step_open=True)
        trainer.check_batch(data, trainer.open_loss)
        trainer.add(data)

    def finish_train_step(self) -> dict[str, Any]:
        """DP-reduce and normalize the gradients, clip, step optimizer and scheduler; metrics."""
        return self.guard.trainer("finish_train_step", *GROUPS, step_open=True).finish()

    def abort_train_step(self) -> None:
        """Drop the open step: gradients zeroed; weights, optimizer and scheduler untouched."""
        trainer = self.guard.trainer("abort_train_step", step_open=True)
        on_device = self.memory.where()["grads"] is Where.DEVICE
        trainer.abort(zero=on_device)
        if not on_device:  # a paused or offloaded step: its gradients are dropped where they are
            self.memory.place({"grads": Where.FREED})

    def enable_forward_pre_hook(self) -> None:
        """Gather parameters in the forward's pre-hooks (`optimizer.overlap_param_gather`)."""
        self.state.overlap.enable_hooks()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove those hooks; a pending gather completes now, whatever `param_sync` says."""
        del param_sync  # a forward without hooks must never read stale shards
        self.state.overlap.disable_hooks()

    def set_learning_rate(self, lr: float) -> None:
        """Restart the schedule at a new peak lr (e.g. SFT warm-up, then RL at a smaller lr)."""
        self.guard.trainer("set_learning_rate", step_open=None).set_lr(lr)

    # --- memory phases (policyworker.memory.phases has the table) ------------------------------

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Params on the device; optimizer state out, idle gradients freed (unless `keep_...`)."""
        keep = MemoryPhase.LP_INFERENCE_KEEP_TRAIN_BUFFERS
        self._phase(keep if keep_train_buffers else MemoryPhase.LP_INFERENCE)

    prepare_for_training = _phase_call(
        MemoryPhase.TRAINING, "Params, gradients and optimizer state on the device."
    )
    finish_inference = _phase_call(
        MemoryPhase.FINISH_INFERENCE, "Params and optimizer state to the host."
    )
    offload_before_refit = _phase_call(
        MemoryPhase.BEFORE_REFIT,
        "Gradients freed (an open step's to the host), optimizer state to the host.",
    )
    offload_after_refit = _phase_call(
        MemoryPhase.AFTER_REFIT, "Everything to the host: the device keeps only the CUDA context."
    )
    pause_train_step_with_offloading = _phase_call(
        MemoryPhase.PAUSE_TRAIN_STEP,
        "Params and optimizer state to the host; an open step's gradients stay.",
    )

    def move_model(
        self, model: torch.nn.Module, device: str, move_params: bool = True, move_grads: bool = True
    ) -> torch.nn.Module:
        """Params and/or gradients to "cpu" or "cuda" (this worker's device; idle grads freed)."""
        if model is not self.state.model and model is not self.state.ddp:
            raise ValueError("model: expected this worker's model")
        self.memory.place_model(
            Where.of_device(device),
            params=move_params,
            grads=move_grads,
            step_open=self.guard.step_open,
        )
        return model

    def move_optimizer(self, device: str) -> None:
        """Move the optimizer state (fp32 masters, Adam's moments): "cpu" or "cuda"."""
        self.memory.place({"optimizer": Where.of_device(device)})

    def memory_stats(self) -> dict[str, object]:
        """The numbers of each phase's DEBUG line: device bytes and where the state is."""
        return memory_stats(self.memory)

    def check_tensor_parallel_attributes(self) -> dict[str, Any]:
        """The seed's report: this rank's parameter names split by megatron's TP attribute."""
        return tensor_parallel_report(self.state.model, self.dims.tp)

    def _phase(self, phase: MemoryPhase) -> None:
        enter_phase(self.memory, phase, step_open=self.guard.step_open)
        if self.trainer is not None and phase not in TRAIN_BUFFERS_KEPT:
            self.trainer.teachers.release()  # a train step stages them again

    # --- refit (policyworker.refit; docs/refit.md) ---------------------------------------------

    def prepare_refit_info(self) -> RefitInfo:
        """`{hf_name: (shape, dtype)}` of the whole model in refit order (collective over PP)."""
        return self.refit.weights.info()

    def enable_refit_prequantize(self, param_names: list[str]) -> RefitInfo:
        """Send `param_names` as MXFP8 (+ `*_scale_from_checkpoint`); the updated refit info."""
        return self.refit.prequantize(param_names)

    def get_zmq_address(self) -> str:
        """The ZMQ endpoint this rank's colocated receiver connects to for IPC refits."""
        return self.refit.ipc.address

    @property
    def weight_version(self) -> int:
        """Version of the last refit this rank sent (0: none); each refit increments it."""
        return self.refit.weights.version

    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int = 0, refit_timeout_s: float | None = None, send: bool = True
    ) -> RefitReport | None:
        """Refit the receiver at `get_zmq_address()`; collective (TP/PP), `send=False` gathers."""
        self.guard.require("stream_weights_via_ipc_zmq", "params")
        return self.refit.ipc.send(
            buffer_size_bytes=buffer_size_bytes, timeout_s=refit_timeout_s, send=send
        )

    def init_collective(
        self, host: str, port: int, world_size: int, refit_timeout_s: float | None = None
    ) -> None:
        """Form the collective refit group; trainer rank 0 is its rank 0 and hosts host:port."""
        self.refit.collective.join(host, port, world_size, refit_timeout_s)

    def broadcast_weights_for_collective(
        self,
        refit_timeout_s: float | None = None,
        buffer_size_bytes: int | None = None,
        num_buffers: int = 2,
    ) -> RefitReport | None:
        """Broadcast every weight to the receivers of `init_collective` (collective over TP/PP)."""
        self.guard.require("broadcast_weights_for_collective", "params")
        return self.refit.collective.send(
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
        """Join the reshard group (every trainer and destination rank; trainer rank 0 hosts)."""
        self.refit.reshard.join(host, port, sources, destinations, refit_timeout_s)

    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> RefitReport | int | None:
        """Refit `init_reshard`'s destinations in their own TP layout (rank 0: the report)."""
        self.guard.require("nccl_reshard_refit", "params")
        return self.refit.reshard.send(timeout_s=refit_timeout_s)

    def init_remote_sparse_delta_baseline(
        self, *, shard_rank: int, shard_count: int, transport: str
    ) -> RefitInfo:
        """Keep this producer's share of the weights as the sparse refit's baseline; refit info."""
        self.guard.require("init_remote_sparse_delta_baseline", "params")
        return self.refit.sparse.baseline(shard_rank, shard_count, transport)

    def stream_remote_sparse_weights(
        self,
        transport: str,
        targets: list[str],
        *,
        transfer_id: str,
        api_key_env_var: str | None,
        timeout_s: float,
        shard_rank: int,
        shard_count: int,
        overwrite_names: list[str],
        full_resync: bool = False,
    ) -> dict[str, int]:
        """Send the elements changed since the baseline to every receiver (docs/refit.md);
        `full_resync`: every tensor whole, to receivers at any version."""
        self.guard.require("stream_remote_sparse_weights", "params")
        call = SparseCall(
            transport=transport,
            transfer_id=transfer_id,
            timeout_s=timeout_s,
            api_key_env_var=api_key_env_var,
            shard_rank=shard_rank,
            shard_count=shard_count,
            overwrite_names=list(overwrite_names),
            full_resync=bool(full_resync),
        )
        return self.refit.sparse.send(targets, call)

    def finish_remote_sparse_delta_sync(self, *, succeeded: bool) -> None:
        """After every receiver applied the refit: advance the baseline (`succeeded`) or not."""
        self.refit.sparse.finish(succeeded)

    # --- checkpoints (policyworker.checkpoint) and HF export -------------------------------------

    def save_checkpoint(
        self,
        weights_path: str | Path,
        optimizer_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        async_save: bool | None = None,
    ) -> None:
        """Save the weights (and the training state); collective. Async: `finalize_async_save`."""
        if tokenizer_path is not None and self.tokenizer is None:
            raise ValueError("tokenizer_path: this worker has no tokenizer (pass tokenizer=)")
        pending, has_optimizer = self.checkpoints.pending_targets, self.trainer is not None
        paths = check_save_paths(weights_path, optimizer_path, has_optimizer, pending=pending)
        if paths[1] is not None or self.guard.step_open:
            self.guard.trainer("save_checkpoint")
        self.guard.require("save_checkpoint", "params", *(("optimizer",) if paths[1] else ()))
        self.state.overlap.sync_params()  # whole parameters, not the step's pending shards
        self.checkpoints.save(
            *paths,
            tokenizer=self.tokenizer,
            async_save=self.cfg.checkpoint.async_save if async_save is None else async_save,
            tokenizer_path=None if tokenizer_path is None else Path(tokenizer_path),
        )

    def finalize_async_save(self) -> bool:
        """Finish and commit the pending async save (collective); False if there was none."""
        return self.checkpoints.finalize()

    def load_checkpoint(
        self, weights_path: str | Path, optimizer_path: str | Path | None = None
    ) -> None:
        """Load a checkpoint into any layout; collective; `CheckpointError` changes nothing."""
        if optimizer_path is not None or self.guard.step_open:
            self.guard.trainer("load_checkpoint", damaged_ok=True)
        self.guard.require("load_checkpoint", *(GROUPS if optimizer_path else ("params",)))
        opt = None if optimizer_path is None else Path(optimizer_path)
        self.checkpoints.load(Path(weights_path), opt)

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) of this pipeline stage, TP shards gathered (collective over TP)."""
        self.guard.require("export_hf_weights", "params")
        return self.refit.weights.hf_weights()

    def save_hf_pretrained(self, folder: str | Path) -> Path:
        """A Hugging Face folder of the live weights (collective; one writer per stage)."""
        tensors, g = self.export_hf_weights(), self.groups
        return save_hf_folder(
            folder,
            hf_config=self.hf_config,
            tensors=tensors,
            tokenizer=self.tokenizer,
            writer=g.leads_replica,
            part=g.pp_rank,
        )
