"""Policy: the driver. One object owns a group of workers and runs each call on all of them.

    with Policy(PolicyConfig(model_name="/ckpt"), num_workers=2, backend="local") as policy:
        lp = policy.get_logprobs(data=batch)["logprobs"]     # the whole batch, in its order
        metrics = policy.train(batch, ClippedPGLoss())

Each worker call (`interface.PolicyCalls`: its signature and documentation) is declared once
below with how its arguments travel (`Call`): the batch of
a sharded call is split over data parallel and its outputs merged; everything else is given to
every rank. A call a rank failed raises that rank's exception (its own type), with a
`WorkerError` (rank, call, remote traceback) as its cause; a dead or hung rank raises
`WorkerError`.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from policyworker.config import PolicyConfig, as_policy_config, finite
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import ROUTES, ROW_IDS, BatchRules, check_row_ids
from policyworker.driver.dispatch import Call, Output, Split, merge, split_rows
from policyworker.driver.group import WorkerGroup
from policyworker.driver.local import LocalGroup, local_envs
from policyworker.interface import PolicyCalls
from policyworker.losses.common import Loss
from policyworker.model.hf_config import load_hf_config, model_shape
from policyworker.model.layout_checks import check_layout
from policyworker.ops.sampling import pad_token
from policyworker.parallel.dims import ParallelDims

log = logging.getLogger(__name__)

BACKENDS = ("local", "ray")

_OPEN: weakref.WeakSet[Policy] = weakref.WeakSet()
"""Every Policy not shut down: shut down at interpreter exit (a pending async save is
committed before the worker processes go)."""
atexit.register(lambda: [policy.shutdown() for policy in list(_OPEN)])


class _Dispatched:
    """A worker method run on the whole group, as its `Call` declares. When the `Policy` class
    is made, it puts a plain method of the worker's name in its own place (so `help(Policy)`
    shows the signature): the worker's parameters, which may also be given positionally (as
    NeMo-RL's `Policy` takes `data`), and a keyword-only `timer` (the reference's Timer: the
    call's phases are timed into it when given)."""

    def __init__(self, call: Call) -> None:
        self.call = call

    def __set_name__(self, owner: type, name: str) -> None:
        method = getattr(PolicyCalls, name)
        params = list(inspect.signature(method).parameters.values())
        own = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params[1:]]
        binding = inspect.Signature(own)
        timer = inspect.Parameter("timer", inspect.Parameter.KEYWORD_ONLY, default=None)
        call = self.call

        def run(policy: Policy, *args: Any, timer: Any = None, **kwargs: Any) -> Any:
            arguments = binding.bind(*args, **kwargs).arguments
            return policy._dispatch(name, call, arguments, timer)

        run.__name__, run.__qualname__ = name, f"{owner.__name__}.{name}"
        run.__doc__ = method.__doc__
        run.__signature__ = inspect.Signature([params[0], *own, timer])  # type: ignore[attr-defined]
        setattr(owner, name, run)


def dispatched(
    output: Output = Output.FIRST,
    *,
    sharded: str | None = None,
    split: Split = Split.BALANCED,
    per_rank: tuple[str, ...] = (),
    indexed: bool = False,
) -> Any:
    call = Call(output, sharded=sharded, split=split, per_rank=per_rank, indexed=indexed)
    return _Dispatched(call)


class Policy:
    """A group of `MegatronPolicyWorker`s, one per rank, driven as one worker.

    Args:
        config: every worker's config; its `parallel` sizes lay the ranks out (data parallel
            takes the rest of `num_workers`).
        num_workers: ranks (processes); one GPU each where there are GPUs.
        backend: "local" (processes spawned here, pipes) or "ray" (one actor per rank).
        failure_timeout_s: after a rank fails, how long the others may take to answer before the
            call raises; a dead rank fails the call at once.
        call_timeout_s: longest a call may run (None: no limit).
        ray_address: the Ray cluster to join (default: `RAY_ADDRESS`, else a local one).
        env: extra environment variables for every worker.
    The other arguments are `MegatronPolicyWorker`'s.
    """

    def __init__(
        self,
        config: PolicyConfig | Mapping[str, Any],
        num_workers: int = 1,
        *,
        backend: str = "local",
        tokenizer: Any = None,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        is_refit_destination: bool = False,
        failure_timeout_s: float = 60.0,
        call_timeout_s: float | None = None,
        start_timeout_s: float = 900.0,
        ray_address: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self._closed = True  # until the group is up: shutdown() has nothing to stop
        config = as_policy_config(config)  # NeMo-RL passes its configs as dicts
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        for name, value in (
            ("failure_timeout_s", failure_timeout_s),
            ("call_timeout_s", call_timeout_s),
        ):
            if value is not None and not (finite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
        p = config.parallel
        self.mesh = ParallelDims.from_world(
            world_size=num_workers,
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            cp=p.context_parallel_size,
            ep=p.expert_model_parallel_size,
            etp=p.expert_tensor_parallel_size,
            sp=p.sequence_parallel,
            world_field="num_workers",
        )
        self.cfg = config
        hf_config = load_hf_config(config.model_name, require_weights=weights_path is None)
        self.shape = model_shape(hf_config)
        self.rules = BatchRules(config.max_total_sequence_length, self.shape.vocab_size)
        """What every batch meets, checked here before a worker sees it (as each worker does)."""
        # generated rows of different shards: padded as one worker pads them
        self._pads = {"output_ids": pad_token(hf_config, tokenizer), ROUTES: -1}
        check_layout(p, self.shape, config.moe, config.recompute)
        gpus = torch.cuda.device_count()
        if backend == "local" and gpus and gpus < num_workers:
            raise ValueError(
                f"num_workers: expected at most the {gpus} GPUs here, got {num_workers}"
            )
        self.device = torch.device("cuda", 0) if gpus else torch.device("cpu")
        self.backend = backend
        worker_env = {**_worker_env(), **(env or {})}
        envs = local_envs(num_workers, worker_env)
        self._group = self._build_group(
            backend, envs, failure_timeout_s, call_timeout_s, ray_address
        )
        kwargs = dict(
            config=config,
            tokenizer=tokenizer,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
            is_refit_destination=is_refit_destination,
        )
        try:
            self._group.start(kwargs, start_timeout_s)
        except BaseException:
            self._group.shutdown()
            raise
        self._closed = False
        _OPEN.add(self)
        log.info("policy: %d %s workers up, mesh %s", num_workers, backend, self.mesh)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def last_call_worker_s(self) -> float:
        """Seconds the last call ran inside the slowest worker; the rest of its wall time is the
        driver's own (sharding, transport, merging)."""
        return self._group.last_worker_s

    @property
    def pids(self) -> list[int]:
        """Each rank's process id."""
        return list(self._group.pids)

    # --- the worker's calls ----------------------------------------------------------------------

    get_logprobs = dispatched(Output.BATCH, sharded="data")
    get_reference_policy_logprobs = dispatched(Output.BATCH, sharded="data")
    get_topk_logits = dispatched(Output.BATCH, sharded="data")
    calibrate_qkv_fp8_scales = dispatched(Output.FIRST, sharded="data")
    get_logprobs_with_full_payload = dispatched(Output.BATCH, sharded="data")
    generate = dispatched(Output.BATCH, sharded="data", indexed=True)
    load_opd_full_teacher_lm_head = dispatched()
    train = dispatched(sharded="data", split=Split.GLOBAL_BATCHES)
    begin_train_step = dispatched()
    train_microbatch = dispatched(sharded="data", split=Split.CONTIGUOUS)
    finish_train_step = dispatched()
    abort_train_step = dispatched()
    set_learning_rate = dispatched()
    enable_forward_pre_hook = dispatched()
    disable_forward_pre_hook = dispatched()
    save_hf_pretrained = dispatched()

    prepare_for_lp_inference = dispatched()
    prepare_for_training = dispatched()
    finish_inference = dispatched()
    offload_before_refit = dispatched()
    offload_after_refit = dispatched()
    pause_train_step_with_offloading = dispatched()
    memory_stats = dispatched(Output.ALL)
    check_tensor_parallel_attributes = dispatched(Output.ALL)

    prepare_refit_info = dispatched()
    enable_refit_prequantize = dispatched()
    get_zmq_address = dispatched(Output.ALL)
    stream_weights_via_ipc_zmq = dispatched(Output.ALL, per_rank=("send",))
    init_collective = dispatched()
    broadcast_weights_for_collective = dispatched()
    init_reshard = dispatched()
    nccl_reshard_refit = dispatched()
    init_remote_sparse_delta_baseline = dispatched(per_rank=("shard_rank",))
    stream_remote_sparse_weights = dispatched(Output.ALL, per_rank=("shard_rank",))
    finish_remote_sparse_delta_sync = dispatched()

    save_checkpoint = dispatched()
    finalize_async_save = dispatched()
    load_checkpoint = dispatched()

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: kept so that NeMo-RL loops that call it run unchanged (there, too, it
        does nothing). The training state stays where the last memory phase put it."""
        del args, kwargs

    # --- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Commit a pending async save, then stop every worker process (idempotent); nothing of
        the group is left running. A broken group cannot commit: its pending save is lost."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._group.broken is None:
                self._group.run("finalize_async_save", [{}] * self.world_size)
            else:
                log.warning("shutdown: the group is broken; a pending async save is lost")
        except Exception as e:
            log.warning("shutdown: a pending async save was not committed: %s", e)
        finally:
            self._group.shutdown()

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- dispatch --------------------------------------------------------------------------------

    def _dispatch(self, name: str, call: Call, args: dict[str, Any], timer: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"{name}: this Policy is shut down")
        world = self.world_size
        per_rank = [dict(args) for _ in range(world)]
        for arg in call.per_rank:
            values = args.get(arg)
            if isinstance(values, list | tuple):
                if len(values) != world:
                    raise ValueError(
                        f"{arg}: expected one value per rank ({world}), got {len(values)}"
                    )
                for r in range(world):
                    per_rank[r][arg] = values[r]
        rows: list[list[int]] = []
        if call.sharded is not None:
            with _timed(timer, f"{name}/shard_data"):
                rows = self._shard(call, args)
                data: BatchedDataDict = args[call.sharded]
                if call.indexed and ROW_IDS not in data:  # a shallow copy: the caller's is kept
                    data = BatchedDataDict({**data, ROW_IDS: torch.arange(sum(map(len, rows)))})
                # one replica: the batch as given, no copies (index ops cost ms on a busy host)
                shards = [data] if len(rows) == 1 else [data.select_indices(r) for r in rows]
                for r in range(world):
                    per_rank[r][call.sharded] = shards[self.mesh.coords(r)["dp"]]
        with _timed(timer, f"{name}/run_workers"):
            answers = self._group.run(name, per_rank)
        if call.output is Output.ALL:
            return answers
        if call.output is Output.FIRST:
            return answers[0]
        with _timed(timer, f"{name}/merge_results"):
            leaders = [answers[self.mesh.leader(d)] for d in range(len(rows))]
            return leaders[0] if len(rows) == 1 else merge(leaders, rows, self._pads)

    def _shard(self, call: Call, args: dict[str, Any]) -> list[list[int]]:
        """Rows of each data-parallel shard, after checking the batch here (a bad batch raises
        `ValueError` before any worker sees it)."""
        data = args[call.sharded]  # type: ignore[index]
        loss = args.get("loss_fn")
        required = loss.required_keys if isinstance(loss, Loss) else ()
        b, _ = self.rules.check(data, required)
        if call.indexed:
            check_row_ids(data)
        dp = self.mesh.dp
        if b < dp or (call.split is not Split.BALANCED and b % dp):
            raise ValueError(f"{call.sharded}: {b} rows do not split over data_parallel={dp}")
        block, unit = b, 1
        if call.split is Split.GLOBAL_BATCHES:
            block = args.get("gbs") or self.cfg.train_global_batch_size
            unit = loss.rows_per_example if isinstance(loss, Loss) else 1
            if b % block or block % (dp * unit):
                raise ValueError(
                    f"gbs: expected a divisor of the batch ({b} rows) and a multiple of "
                    f"data_parallel x rows per example = {dp} x {unit}, got {block}"
                )
        lengths = data["input_lengths"].tolist()
        return split_rows(lengths, dp, call.split, block=block, unit=unit)

    def _build_group(
        self,
        backend: str,
        envs: list[dict[str, str]],
        failure_timeout_s: float,
        call_timeout_s: float | None,
        ray_address: str | None,
    ) -> WorkerGroup:
        common = dict(
            envs=envs,
            log_levels=_log_levels(),
            failure_timeout_s=failure_timeout_s,
            call_timeout_s=call_timeout_s,
        )
        if backend == "local":
            return LocalGroup(len(envs), **common)  # type: ignore[arg-type]
        from policyworker.driver.ray_group import RayGroup
        from policyworker.worker import MegatronPolicyWorker

        return RayGroup(
            len(envs),
            address=ray_address,
            configure=MegatronPolicyWorker.configure_worker,
            **common,  # type: ignore[arg-type]
        )


def _timed(timer: Any, label: str) -> contextlib.AbstractContextManager[Any]:
    """`timer.time(label)` (NeMo-RL's Timer protocol), or nothing without a timer."""
    return contextlib.nullcontext() if timer is None else timer.time(label)


def _worker_env() -> dict[str, str]:
    """Variables every worker gets: NVLink multicast off in NCCL, PyTorch and NVSHMEM (it can
    take shared GPUs out of service; the GPU machines we test on require it off); OpenMP threads
    that sleep when idle instead of spinning, which otherwise steal the cores the driver and the
    other workers need between calls (measured: most of the driver's own cost per call)."""
    return {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    }


def _log_levels() -> dict[str, int]:
    """The driver's logging levels ("" is the root's) for the workers to use."""
    levels = {"": logging.getLogger().getEffectiveLevel()}
    for name, logger in logging.root.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and logger.level and name.startswith("policyworker"):
            levels[name] = logger.level
    return levels


def rank_flags(world_size: int, ranks: Sequence[int]) -> list[bool]:
    """A per-rank argument that is True on `ranks` only (e.g. `send` of an IPC refit)."""
    return [r in ranks for r in range(world_size)]
