"""MegatronPolicyWorker, the public facade: it implements the calls `interface.PolicyCalls`
declares (their signatures and documentation are there), validates (`guard.Guard`), then delegates
to `train.Trainer`, `train.Scorer`, `refit.Refit` (a source per transport), `memory.Residency`
and `checkpoint.Checkpointer` (put together by `assembly`). A bad call raises `ValueError` before
any state changes.

    worker = MegatronPolicyWorker(PolicyConfig(model_name="/ckpt"))
    lp = worker.get_logprobs(data=batch)["logprobs"]                  # [B, S]
    metrics = worker.train(batch, ClippedPGLoss())
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from policyworker.checkpoint.hf import save_hf_folder, save_peft_folder
from policyworker.checkpoint.paths import check_save_paths, initial_weights
from policyworker.config import PolicyConfig, as_policy_config, teacher_path
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.guard import Guard
from policyworker.interface import PolicyCalls
from policyworker.logs import quiet_third_party
from policyworker.losses.common import Loss
from policyworker.memory.phases import TRAIN_BUFFERS_KEPT, MemoryPhase, enter_phase
from policyworker.memory.residency import GROUPS, Where
from policyworker.memory.telemetry import memory_stats
from policyworker.model.report import tensor_parallel_report


def _phase_call(phase: MemoryPhase) -> Any:
    """A worker call that enters `phase` (`memory/phases.py` has the table), declared in one line."""

    def call(self: MegatronPolicyWorker) -> None:
        self._phase(phase)

    call.__name__, call.__qualname__ = str(phase), f"MegatronPolicyWorker.{phase}"
    return call


class _Delegated:
    """A worker call that checks that its `needs` (groups of state) are on the device, then hands
    its arguments, by name, to the service method at `path` (e.g. "refit.ipc.send"). Its
    signature and documentation are `PolicyCalls`'; the worker class gets a plain method."""

    def __init__(self, path: str, needs: tuple[str, ...]) -> None:
        self.path, self.target, self.needs = path, operator.attrgetter(path), needs

    def __set_name__(self, owner: type, name: str) -> None:
        signature = inspect.signature(getattr(PolicyCalls, name))
        target, needs = self.target, self.needs
        _, *names = signature.parameters  # the first is the worker

        def call(worker: MegatronPolicyWorker, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(worker, *args, **kwargs)
            bound.apply_defaults()
            if needs:
                worker.guard.require(name, *needs)
            return target(worker)(**{n: bound.arguments[n] for n in names})

        call.__name__, call.__qualname__ = name, f"{owner.__name__}.{name}"
        call.__signature__ = signature  # type: ignore[attr-defined]
        call.delegates_to = self.path  # type: ignore[attr-defined]  # for readers (and a test)
        setattr(owner, name, call)


def _delegate(path: str, *needs: str) -> Any:
    return _Delegated(path, needs)


class MegatronPolicyWorker(PolicyCalls):
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
        from policyworker import assembly  # megatron-core loads here, when a worker is built
        from policyworker.train.calibration import Calibration

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
        self.calibration = Calibration(self.scorer, self.state.model)
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
        self.checkpoints.close()
        self.refit.close()

    @staticmethod
    def configure_worker(
        num_gpus: int, bundle_indices: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        del bundle_indices
        return {"num_gpus": num_gpus, "num_cpus": 1}, {}, {}

    # --- inference -------------------------------------------------------------------------------

    get_logprobs = _delegate("scorer.get_logprobs", "params")

    def get_reference_policy_logprobs(
        self, *, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        with self.use_reference_model():  # its routers choose (no replay, as NeMo-RL)
            out = self.get_logprobs(
                data=data, micro_batch_size=micro_batch_size, require_router_replay=False
            )
        return BatchedDataDict({"reference_logprobs": out["logprobs"]})

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        if self.state.reference is None:
            raise ValueError("init_reference_model=False: this worker holds no reference model")
        self.guard.require("use_reference_model", "params")
        with self.state.reference_swapped_in():
            yield

    get_topk_logits = _delegate("scorer.get_topk_logits", "params")
    get_logprobs_with_full_payload = _delegate("scorer.get_logprobs_with_full_payload", "params")
    generate = _delegate("sampler.generate", "params")
    calibrate_qkv_fp8_scales = _delegate("calibration.calibrate_qkv_fp8_scales", "params")

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
        if check_dim_skip_keys is not None:
            raise ValueError("check_dim_skip_keys: expected None (no cross-tokenizer fields here)")
        trainer = self.guard.trainer("train", *(("params",) if eval_mode else GROUPS))
        trainer.check_batch(data, loss_fn)
        return trainer.train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)

    def load_opd_full_teacher_lm_head(self, teacher_path_config: Any, teacher_index: int) -> str:
        path = teacher_path(teacher_path_config)
        self.guard.trainer("load_opd_full_teacher_lm_head", step_open=None).teachers.load(
            path, teacher_index
        )
        return path

    def begin_train_step(
        self, loss_fn: Loss, gbs: int | None = None, mbs: int | None = None
    ) -> None:
        self.guard.trainer("begin_train_step", *GROUPS).begin(loss_fn, gbs, mbs)

    def train_microbatch(self, data: BatchedDataDict) -> None:
        trainer = self.guard.trainer("train_microbatch", "params", "grads", step_open=True)
        trainer.check_batch(data, trainer.open_loss)
        trainer.add(data)

    def finish_train_step(self) -> dict[str, Any]:
        return self.guard.trainer("finish_train_step", *GROUPS, step_open=True).finish()

    def abort_train_step(self) -> None:
        trainer = self.guard.trainer("abort_train_step", step_open=True)
        on_device = self.memory.where()["grads"] is Where.DEVICE
        trainer.abort(zero=on_device)
        if not on_device:  # a paused or offloaded step: its gradients are dropped where they are
            self.memory.place({"grads": Where.FREED})

    def enable_forward_pre_hook(self) -> None:
        self.state.overlap.enable_hooks()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        del param_sync  # a forward without hooks must never read stale shards
        self.state.overlap.disable_hooks()

    def set_learning_rate(self, lr: float) -> None:
        self.guard.trainer("set_learning_rate", step_open=None).set_lr(lr)

    # --- memory phases (policyworker.memory.phases has the table) ------------------------------

    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        keep = MemoryPhase.LP_INFERENCE_KEEP_TRAIN_BUFFERS
        self._phase(keep if keep_train_buffers else MemoryPhase.LP_INFERENCE)

    prepare_for_training = _phase_call(MemoryPhase.TRAINING)
    finish_inference = _phase_call(MemoryPhase.FINISH_INFERENCE)
    offload_before_refit = _phase_call(MemoryPhase.BEFORE_REFIT)
    offload_after_refit = _phase_call(MemoryPhase.AFTER_REFIT)
    pause_train_step_with_offloading = _phase_call(MemoryPhase.PAUSE_TRAIN_STEP)

    def move_model(
        self, model: torch.nn.Module, device: str, move_params: bool = True, move_grads: bool = True
    ) -> torch.nn.Module:
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
        self.memory.place({"optimizer": Where.of_device(device)})

    def memory_stats(self) -> dict[str, object]:
        return memory_stats(self.memory)

    def check_tensor_parallel_attributes(self) -> dict[str, Any]:
        return tensor_parallel_report(self.state.model, self.dims.tp)

    def _phase(self, phase: MemoryPhase) -> None:
        enter_phase(self.memory, phase, step_open=self.guard.step_open)
        if self.trainer is not None and phase not in TRAIN_BUFFERS_KEPT:
            self.trainer.teachers.release()  # a train step stages them again

    # --- refit (policyworker.refit; docs/refit.md) ---------------------------------------------

    prepare_refit_info = _delegate("refit.weights.info")
    enable_refit_prequantize = _delegate("refit.prequantize")

    def get_zmq_address(self) -> str:
        return self.refit.ipc.address

    @property
    def weight_version(self) -> int:
        return self.refit.weights.version

    stream_weights_via_ipc_zmq = _delegate("refit.ipc.send", "params")
    init_collective = _delegate("refit.collective.join")
    broadcast_weights_for_collective = _delegate("refit.collective.send", "params")
    init_reshard = _delegate("refit.reshard.join")
    nccl_reshard_refit = _delegate("refit.reshard.send", "params")
    init_remote_sparse_delta_baseline = _delegate("refit.sparse.baseline", "params")
    stream_remote_sparse_weights = _delegate("refit.sparse.send", "params")
    finish_remote_sparse_delta_sync = _delegate("refit.sparse.finish")

    # --- checkpoints (policyworker.checkpoint) and HF export -------------------------------------

    def save_checkpoint(
        self,
        weights_path: str | Path,
        optimizer_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        async_save: bool | None = None,
    ) -> None:
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

    finalize_async_save = _delegate("checkpoints.finalize")

    def load_checkpoint(
        self, weights_path: str | Path, optimizer_path: str | Path | None = None
    ) -> None:
        if optimizer_path is not None or self.guard.step_open:
            self.guard.trainer("load_checkpoint", damaged_ok=True)
        self.guard.require("load_checkpoint", *(GROUPS if optimizer_path else ("params",)))
        opt = None if optimizer_path is None else Path(optimizer_path)
        self.checkpoints.load(Path(weights_path), opt)

    export_hf_weights = _delegate("refit.weights.hf_weights", "params")

    def save_peft_adapter(self, folder: str | Path) -> Path:
        """LoRA's adapters (`peft.enabled`) as a PEFT folder `peft` loads onto the base."""
        from policyworker.model import lora
        from policyworker.model.build import global_named_parameters

        if self.state.adapters is None or self.dims.pp > 1:
            raise ValueError("save_peft_adapter: needs peft.enabled (and, for now, one stage)")
        tensors = lora.peft_tensors(global_named_parameters(self.state.model), self.shape)
        config = lora.peft_config(self.cfg.peft, tensors, self.cfg.model_name)
        return save_peft_folder(folder, tensors=tensors, adapter_config=config)

    def save_hf_pretrained(self, folder: str | Path) -> Path:
        tensors, g = self.export_hf_weights(), self.groups
        return save_hf_folder(
            folder,
            hf_config=self.hf_config,
            tensors=tensors,
            tokenizer=self.tokenizer,
            writer=g.leads_replica,
            part=g.pp_rank,
        )
