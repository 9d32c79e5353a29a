"""Save and load distributed checkpoints (megatron-core dist_checkpointing, torch_dist format).

    ckpt = Checkpointer(...)
    ckpt.save(weights_dir, optimizer_dir, async_save=True)   # returns after host staging
    ...                                                       # train on; the write goes on
    ckpt.finalize()                                           # wait, then commit (rename)
    counters = ckpt.load(weights_dir, optimizer_dir)

Sync and async saves are one path: the same write requests run inline or in a background thread,
so their files are identical. Every save is collective (all ranks call it); each directory is
written into a temporary sibling and renamed into place by rank 0 after every rank finished
(`checkpoint.commit`). The weights and the training state share a `save_id`, so a load refuses an
optimizer directory from another save.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from policyworker.checkpoint import integrity
from policyworker.checkpoint import state as sd
from policyworker.checkpoint.commit import (
    CheckpointError,
    commit,
    fault_point,
    file_sizes,
    from_rank0,
    gather,
    is_checkpoint,
    make_tmp,
    rank,
    read_manifest,
    write_manifest,
)
from policyworker.memory.host import HostArena
from policyworker.model.hf_config import ModelShape
from policyworker.parallel.dims import Groups, ParallelDims

log = logging.getLogger(__name__)

HF_SUBDIR = "hf"
"""Inside a weights checkpoint: the HF config (and tokenizer files), for export."""

# Fields of ModelShape that must agree between a checkpoint and the model it loads into.
_SHAPE_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


@dataclass(slots=True)
class Trainee:
    """What a checkpoint reads and restores: the worker's model, optimizer and layout."""

    model: torch.nn.Module
    optimizer: Any | None
    scheduler: Any | None
    groups: Groups
    dims: ParallelDims
    shape: ModelShape
    hf_config: Any
    precision: str


@dataclass(slots=True)
class _Pending:
    """An async save between `save` and `finalize`."""

    requests: list[tuple[AsyncRequest, list[Any]]]
    commits: list[tuple[Path, Path, dict[str, Any]]]  # (tmp, target, manifest)
    thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)


class Checkpointer:
    """One rank's checkpoint I/O; holds at most one unfinished async save."""

    def __init__(self, trainee: Trainee, *, verify_integrity: bool, writer_threads: int) -> None:
        self.t = trainee
        self.verify_integrity = verify_integrity
        self.writer_threads = writer_threads
        # One save strategy per directory kind, kept: after the first save megatron reuses its
        # plans, and the sharding is validated once (the model's sharding does not change).
        self._strategies: dict[str, TorchDistSaveShardedStrategy] = {}
        self._pending: _Pending | None = None
        self._arena: HostArena | None = None  # staging memory, reused by every save
        self.last_save_timing: dict[str, float] = {}
        """The last save's bytes staged and seconds since its call when: the sharded state dicts
        were built, the host copies issued (a first save allocates their memory), the write
        planned, the copies done."""

    # --- save ------------------------------------------------------------------------------------

    def save(
        self,
        weights_path: Path,
        optimizer_path: Path | None,
        *,
        counters: dict[str, int],
        tokenizer: Any | None,
        async_save: bool,
    ) -> None:
        """Stage to the host and plan the write; write inline (sync) or in the background."""
        self.finalize()  # a second save waits for the first
        start = time.perf_counter()
        t = self.t
        save_id = uuid.uuid4().hex if rank() == 0 else ""
        save_id = from_rank0(lambda: save_id)
        base = {
            "save_id": save_id,
            **counters,
            "model": {k: getattr(t.shape, k) for k in _SHAPE_FIELDS},
            "precision": t.precision,
            "layout": {"tp": t.dims.tp, "pp": t.dims.pp, "cp": t.dims.cp, "dp": t.dims.dp},
            "verify_integrity": self.verify_integrity,
        }
        live_model_sd = sd.model_state(t.model)
        trees: list[tuple[Path, dict[str, Any], dict[str, Any]]] = []
        if optimizer_path is not None:
            opt_tree = {
                "optimizer": sd.optimizer_state(t.optimizer, live_model_sd, is_loading=False),
                "scheduler": t.scheduler.state_dict(),
                "rng": sd.rng_state(t.groups, t.dims),
            }
            opt_meta = {**base, "kind": "training_state", "distributed_optimizer": _is_dist(t)}
            trees.append((optimizer_path, opt_tree, opt_meta))
        trees.insert(0, (weights_path, live_model_sd, {**base, "kind": "weights"}))
        trees_s = time.perf_counter() - start
        arena, self._arena = self._arena, None  # stage may free it before allocating anew
        staged, self._arena = sd.stage([tree for _, tree, _ in trees], arena)
        staged_s = time.perf_counter() - start  # copies issued (waited for after planning)
        pending = _Pending(requests=[], commits=[])
        _in_process_results()
        for target, tree, meta in trees:
            tmp = make_tmp(target)
            first = meta["kind"] not in self._strategies
            strategy = self._strategies.setdefault(
                meta["kind"],
                TorchDistSaveShardedStrategy(
                    thread_count=self.writer_threads, cached_metadata=True
                ),
            )
            request = dist_checkpointing.save(
                tree,
                str(tmp),
                sharded_strategy=strategy,
                validate_access_integrity=first,
                async_sharded_save=True,
                async_strategy="mcore",
            )
            # Not request.preload_fn: the tensors are on the host already, and it synchronizes
            # the device (which would end the overlap with the staging copies).
            pending.requests.append((request, list(request.async_fn_args)))
            pending.commits.append((tmp, target, meta))
        if rank() == 0:
            _write_hf_files(pending.commits[0][0], t.hf_config, tokenizer)
        planned_s = time.perf_counter() - start
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the staging copies, which the planning above overlapped
        done_s = time.perf_counter() - start
        self.last_save_timing = dict(
            state_dicts_s=trees_s, stage_s=staged_s, planned_s=planned_s, staged_s=done_s
        ) | {"staged_bytes": float(staged)}
        self._pending = pending
        if async_save:
            pending.thread = threading.Thread(
                target=_run_writes, args=(pending,), name="checkpoint-writer", daemon=True
            )
            pending.thread.start()
        else:
            _run_writes(pending)
            self.finalize()
        self.last_save_timing["blocking_s"] = time.perf_counter() - start

    def finalize(self) -> bool:
        """Wait for an async save's writes, finish it on every rank and commit it. Returns
        whether there was one. Collective."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        if pending.thread is not None:
            pending.thread.join()
        failures = [f"rank {r}: {e}" for r, e in enumerate(gather(_first(pending.errors))) if e]
        if failures:
            raise CheckpointError(f"checkpoint write failed: {'; '.join(failures)} (not committed)")
        for request, _ in pending.requests:
            for fn in request.finalize_fns:
                fn()  # collective: gathers write results, writes the metadata
        fault_point("checkpoint.commit")

        manifests = []
        for tmp, _, meta in pending.commits:
            files = file_sizes(tmp)
            sha = {"sha256": integrity.digests(tmp, files)} if self.verify_integrity else {}
            manifests.append({**meta, "files": files, **sha})

        def commit_all() -> None:
            for (tmp, target, _), manifest in reversed(
                list(zip(pending.commits, manifests, strict=True))
            ):
                write_manifest(tmp, manifest)  # the weights last
                commit(tmp, target)

        from_rank0(commit_all)
        return True

    # --- load ------------------------------------------------------------------------------------

    def load(self, weights_path: Path, optimizer_path: Path | None) -> dict[str, Any]:
        """Load a checkpoint into the live model (and optimizer, scheduler, RNG); returns the
        weights manifest. Every check and every read happens before a live tensor changes."""
        t = self.t
        self.finalize()
        manifest = read_manifest(weights_path, "weights_path")
        check_model(manifest, t.shape, "weights_path")
        opt_manifest = None
        if optimizer_path is not None:
            opt_manifest = read_manifest(optimizer_path, "optimizer_path")
            if opt_manifest.get("save_id") != manifest.get("save_id"):
                raise CheckpointError(
                    f"optimizer_path: {optimizer_path} was written by another save than "
                    f"weights_path {weights_path} (save_id differs)"
                )
        model_sd = sd.fresh(sd.model_state(t.model))
        loaded = _load(model_sd, weights_path, manifest, "weights_path")
        opt_loaded = None
        if optimizer_path is not None and opt_manifest is not None:
            tree: dict[str, Any] = {
                "optimizer": sd.fresh(
                    sd.optimizer_state(t.optimizer, sd.model_state(t.model), is_loading=True)
                )
            }
            if opt_manifest["layout"] == manifest_layout(t):
                tree["rng"] = sd.rng_state(t.groups, t.dims)
            else:
                log.info("layout changed since the save: RNG states are not restored")
            opt_loaded = _load(tree, optimizer_path, opt_manifest, "optimizer_path")
        _apply(t, loaded, opt_loaded)
        return manifest


def manifest_layout(t: Trainee) -> dict[str, int]:
    return {"tp": t.dims.tp, "pp": t.dims.pp, "cp": t.dims.cp, "dp": t.dims.dp}


def check_model(manifest: dict[str, Any], shape: ModelShape, field: str) -> None:
    """Refuse a checkpoint of another model shape, naming the first field that differs."""
    saved = manifest.get("model", {})
    for key in _SHAPE_FIELDS:
        if saved.get(key) != getattr(shape, key):
            raise CheckpointError(
                f"{field}: the checkpoint is of a model with {key}={saved.get(key)!r}; "
                f"this model has {key}={getattr(shape, key)!r}"
            )


def _load(tree: dict[str, Any], folder: Path, manifest: dict[str, Any], field: str) -> Any:
    if "sha256" in manifest:
        integrity.verify(folder, manifest["sha256"], field)
    try:
        return dist_checkpointing.load(tree, str(folder))
    except Exception as e:  # dist-checkpointing raises many types; name the directory
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{field}: {folder} does not load: {reason[:500]}") from e


def _apply(t: Trainee, loaded: Any, opt_loaded: Any | None) -> None:
    """Copy loaded host tensors into the live model, optimizer, scheduler and RNG."""
    t.model.load_state_dict(loaded, strict=False)
    if opt_loaded is None:
        _reseed_masters(t.optimizer)
        return
    sd.load_optimizer(t.optimizer, opt_loaded["optimizer"])
    t.scheduler.load_state_dict(opt_loaded["scheduler"])
    if "rng" in opt_loaded:
        sd.restore_rng(opt_loaded["rng"])


def _reseed_masters(optimizer: Any | None) -> None:
    """Weights loaded without optimizer state: the fp32 masters must follow the new weights."""
    if optimizer is not None:
        optimizer.reload_model_params()


def _is_dist(t: Trainee) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from policyworker.train.optimizer import optimizer_parts

    return any(isinstance(p, DistributedOptimizer) for p in optimizer_parts(t.optimizer))


def _in_process_results() -> None:
    """Give this save's writers a fresh in-process results queue.

    mcore's writers report through a cached queue that by default a spawned multiprocessing
    Manager serves: a helper process that re-imports the caller's `__main__` (a script without a
    main guard runs twice) and outlives a killed trainer. Our writes run in this process, so a
    thread-safe queue does; a fresh one per save leaves no result of a failed save behind."""
    filesystem_async._results_queue = queue.Queue()


def _run_writes(pending: _Pending) -> None:
    """Write every request's files (inline, or as the background thread's body)."""
    try:
        for request, args in pending.requests:
            if request.async_fn is not None:
                request.async_fn(*args, **request.async_fn_kwargs)
            fault_point("checkpoint.write")  # after the first directory's files
    except BaseException as e:  # reported by finalize on every rank
        pending.errors.append(e)


def _first(errors: list[BaseException]) -> str | None:
    return f"{type(errors[0]).__name__}: {errors[0]}" if errors else None


def _write_hf_files(folder: Path, hf_config: Any, tokenizer: Any | None) -> None:
    hf = folder / HF_SUBDIR
    hf.mkdir(exist_ok=True)
    hf_config.save_pretrained(hf)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf)


def checkpoint_kind(path: Path, field: str) -> str:
    """ "checkpoint" (ours, complete), "hf" (config.json + safetensors) or a `CheckpointError`."""
    if is_checkpoint(path):
        return "checkpoint"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors*")):
        return "hf"
    if path.is_dir() and any(path.glob(".metadata")):
        raise CheckpointError(f"{field}: {path} is an incomplete checkpoint (no manifest)")
    raise CheckpointError(
        f"{field}: {path} is neither a policyworker checkpoint nor a Hugging Face folder"
    )


def check_save_paths(
    weights_path: str | Path, optimizer_path: str | Path | None, *, has_optimizer: bool
) -> tuple[Path, Path | None]:
    """Validate `save_checkpoint`'s directories before anything is staged or written."""
    paths: list[Path | None] = []
    for name, value in (("weights_path", weights_path), ("optimizer_path", optimizer_path)):
        if value is None and name == "optimizer_path":
            paths.append(None)
            continue
        if not isinstance(value, str | Path) or not str(value):
            raise ValueError(f"{name}: expected a directory path, got {value!r}")
        path = Path(value).absolute()
        if path.exists():
            raise ValueError(
                f"{name}: {path} exists; a checkpoint is never written over (choose a new "
                "directory, e.g. one per step, or remove the old one)"
            )
        paths.append(path)
    weights, optimizer = paths
    assert weights is not None
    if optimizer is not None:
        if not has_optimizer:
            raise ValueError("optimizer_path: this worker has no optimizer (init_optimizer=False)")
        if optimizer == weights or weights in optimizer.parents or optimizer in weights.parents:
            raise ValueError(
                f"optimizer_path: expected a directory apart from weights_path, got {optimizer}"
            )
    return weights, optimizer


def initial_weights(
    model_name: str, weights_path: str | None, optimizer_path: str | None, *, init_optimizer: bool
) -> tuple[str | None, Path | None]:
    """Where a new worker's weights come from: (HF folder to read, checkpoint to load after).

    A checkpoint's worker still reads `model_name`'s HF weights when it has them: they are the
    reference model's (the policy the run started from), the checkpoint then replaces the live
    weights."""
    if weights_path is None:
        if optimizer_path is not None:
            raise ValueError("optimizer_path: needs weights_path (the checkpoint it belongs to)")
        return model_name, None
    kind = checkpoint_kind(Path(weights_path), "weights_path")
    if kind == "hf":
        if optimizer_path is not None:
            raise ValueError(
                "optimizer_path: weights_path is a Hugging Face folder, which has no training "
                "state to pair with; pass a policyworker checkpoint"
            )
        return weights_path, None
    if optimizer_path is not None and not init_optimizer:
        raise ValueError("optimizer_path: init_optimizer=False, so there is no optimizer to load")
    has_hf = any(Path(model_name).glob("*.safetensors*"))
    return (model_name if has_hf else None), Path(weights_path)
