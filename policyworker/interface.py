"""The worker's calls — NeMo-RL's `MegatronPolicyWorker` contract — declared once: each call's
signature and what it does. `MegatronPolicyWorker` (worker.py) implements them; the driver's
`Policy` takes every signature from here, so the driver never imports the worker's modules (nor
megatron-core, which a worker loads when it is built).

A bad call raises `ValueError` (or its own subclass of it) before any state changes.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from policyworker.data.batched_data_dict import BatchedDataDict
    from policyworker.losses.common import Loss
    from policyworker.refit.layout import RefitInfo, RefitReport


class PolicyCalls(abc.ABC):
    """Every call of one rank's policy worker. Collective calls (marked so) run on every rank
    of the group at once."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Commit a pending async save (a failed one is removed, with a warning), remove the
        refit endpoint's files. Collective; idempotent; also run at interpreter exit."""

    @staticmethod
    @abc.abstractmethod
    def configure_worker(
        num_gpus: int, bundle_indices: list[int] | None = None
    ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        """A Ray actor's (resources, extra env, extra constructor arguments): one rank each."""

    # --- scoring -----------------------------------------------------------------------------------

    @abc.abstractmethod
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

    @abc.abstractmethod
    def get_reference_policy_logprobs(
        self, *, data: BatchedDataDict, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """`{"reference_logprobs": [B, S]}`: `get_logprobs` under the reference weights."""

    @abc.abstractmethod
    def use_reference_model(self) -> AbstractContextManager[None]:
        """Swap the reference weights into the live parameters; the live ones return on exit."""

    @abc.abstractmethod
    def get_topk_logits(
        self, *, data: BatchedDataDict, k: int, micro_batch_size: int | None = None
    ) -> BatchedDataDict:
        """`{"topk_logits", "topk_indices"}` [B, S, k] of logits / temperature at each position."""

    @abc.abstractmethod
    def get_logprobs_with_full_payload(
        self,
        *,
        data: BatchedDataDict,
        payload: str,
        payload_dtype: str,
        micro_batch_size: int | None = None,
    ) -> BatchedDataDict:
        """`logprobs` [B, S] and, on the last stage, `teacher_full_payload` [B, S, D] on CPU."""

    @abc.abstractmethod
    def generate(
        self, *, data: BatchedDataDict, greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict:
        """Sample responses with this model (`cfg.generation`, a KV cache, no refit): the
        reference's generation keys; their `logprobs` are `get_logprobs`' (ops/sampling.py)."""

    @abc.abstractmethod
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

    # --- training ----------------------------------------------------------------------------------

    @abc.abstractmethod
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

    @abc.abstractmethod
    def load_opd_full_teacher_lm_head(self, teacher_path_config: Any, teacher_index: int) -> str:
        """This rank's shard of a teacher's LM head, for `FullDistillationLoss` on hidden-state
        payloads (`opd_full_teacher_lm_head_lifecycle`); returns the teacher's folder."""

    @abc.abstractmethod
    def begin_train_step(
        self, loss_fn: Loss, gbs: int | None = None, mbs: int | None = None
    ) -> None:
        """Open a step (zero gradients) for `train_microbatch`; `finish_train_step` applies it."""

    @abc.abstractmethod
    def train_microbatch(self, data: BatchedDataDict) -> None:
        """Forward/backward `mbs`-row multiples (no DP reduce yet); an error aborts the step."""

    @abc.abstractmethod
    def finish_train_step(self) -> dict[str, Any]:
        """DP-reduce and normalize the gradients, clip, step optimizer and scheduler; metrics."""

    @abc.abstractmethod
    def abort_train_step(self) -> None:
        """Drop the open step: gradients zeroed; weights, optimizer and scheduler untouched."""

    @abc.abstractmethod
    def enable_forward_pre_hook(self) -> None:
        """Gather parameters in the forward's pre-hooks (`optimizer.overlap_param_gather`)."""

    @abc.abstractmethod
    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove those hooks; a pending gather completes now, whatever `param_sync` says."""

    @abc.abstractmethod
    def set_learning_rate(self, lr: float) -> None:
        """Restart the schedule at a new peak lr (e.g. SFT warm-up, then RL at a smaller lr)."""

    # --- memory phases (memory/phases.py has the table) -------------------------------------------

    @abc.abstractmethod
    def prepare_for_lp_inference(self, keep_train_buffers: bool = False) -> None:
        """Params on the device; optimizer state out, idle gradients freed (unless `keep_...`)."""

    @abc.abstractmethod
    def prepare_for_training(self) -> None:
        """Params, gradients and optimizer state on the device."""

    @abc.abstractmethod
    def finish_inference(self) -> None:
        """Params and optimizer state to the host."""

    @abc.abstractmethod
    def offload_before_refit(self) -> None:
        """Gradients freed (an open step's to the host), optimizer state to the host."""

    @abc.abstractmethod
    def offload_after_refit(self) -> None:
        """Everything to the host: the device keeps only the CUDA context."""

    @abc.abstractmethod
    def pause_train_step_with_offloading(self) -> None:
        """Params and optimizer state to the host; an open step's gradients stay."""

    @abc.abstractmethod
    def move_model(
        self, model: torch.nn.Module, device: str, move_params: bool = True, move_grads: bool = True
    ) -> torch.nn.Module:
        """Params and/or gradients to "cpu" or "cuda" (this worker's device; idle grads freed)."""

    @abc.abstractmethod
    def move_optimizer(self, device: str) -> None:
        """Move the optimizer state (fp32 masters, Adam's moments): "cpu" or "cuda"."""

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, object]:
        """The numbers of each phase's DEBUG line: device bytes and where the state is."""

    @abc.abstractmethod
    def check_tensor_parallel_attributes(self) -> dict[str, Any]:
        """The seed's report: this rank's parameter names split by megatron's TP attribute."""

    # --- refit (docs/refit.md) ---------------------------------------------------------------------

    @abc.abstractmethod
    def prepare_refit_info(self) -> RefitInfo:
        """`{hf_name: (shape, dtype)}` of the whole model in refit order (collective over PP)."""

    @abc.abstractmethod
    def enable_refit_prequantize(self, param_names: list[str]) -> RefitInfo:
        """Send `param_names` as MXFP8 (+ `*_scale_from_checkpoint`); the updated refit info."""

    @abc.abstractmethod
    def get_zmq_address(self) -> str:
        """The ZMQ endpoint this rank's colocated receiver connects to for IPC refits."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the last refit this rank sent (0: none); each refit increments it."""

    @abc.abstractmethod
    def stream_weights_via_ipc_zmq(
        self, buffer_size_bytes: int = 0, refit_timeout_s: float | None = None, send: bool = True
    ) -> RefitReport | None:
        """Refit the receiver at `get_zmq_address()`; collective (TP/PP), `send=False` gathers."""

    @abc.abstractmethod
    def init_collective(
        self, host: str, port: int, world_size: int, refit_timeout_s: float | None = None
    ) -> None:
        """Form the collective refit group; trainer rank 0 is its rank 0 and hosts host:port."""

    @abc.abstractmethod
    def broadcast_weights_for_collective(
        self,
        refit_timeout_s: float | None = None,
        buffer_size_bytes: int | None = None,
        num_buffers: int = 2,
    ) -> RefitReport | None:
        """Broadcast every weight to the receivers of `init_collective` (collective over TP/PP)."""

    @abc.abstractmethod
    def init_reshard(
        self,
        host: str,
        port: int,
        sources: int,
        destinations: int,
        refit_timeout_s: float | None = None,
    ) -> None:
        """Join the reshard group (every trainer and destination rank; trainer rank 0 hosts)."""

    @abc.abstractmethod
    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> RefitReport | int | None:
        """Refit `init_reshard`'s destinations in their own TP layout (rank 0: the report)."""

    @abc.abstractmethod
    def init_remote_sparse_delta_baseline(
        self, *, shard_rank: int, shard_count: int, transport: str
    ) -> RefitInfo:
        """Keep this producer's share of the weights as the sparse refit's baseline; refit info."""

    @abc.abstractmethod
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

    @abc.abstractmethod
    def finish_remote_sparse_delta_sync(self, *, succeeded: bool) -> None:
        """After every receiver applied the refit: advance the baseline (`succeeded`) or not."""

    # --- checkpoints and HF export -----------------------------------------------------------------

    @abc.abstractmethod
    def save_checkpoint(
        self,
        weights_path: str | Path,
        optimizer_path: str | Path | None = None,
        tokenizer_path: str | Path | None = None,
        async_save: bool | None = None,
    ) -> None:
        """Save the weights (and the training state); collective. Async: `finalize_async_save`."""

    @abc.abstractmethod
    def finalize_async_save(self) -> bool:
        """Finish and commit the pending async save (collective); False if there was none."""

    @abc.abstractmethod
    def load_checkpoint(
        self, weights_path: str | Path, optimizer_path: str | Path | None = None
    ) -> None:
        """Load a checkpoint into any layout; collective; `CheckpointError` changes nothing."""

    @abc.abstractmethod
    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) of this pipeline stage, TP shards gathered (collective over TP)."""

    @abc.abstractmethod
    def save_hf_pretrained(self, folder: str | Path) -> Path:
        """A Hugging Face folder of the live weights (collective; one writer per stage)."""
