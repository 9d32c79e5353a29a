"""Save and load distributed checkpoints (megatron-core dist_checkpointing, torch_dist format).

    ckpt = Checkpointer(...)
    ckpt.save(weights_dir, optimizer_dir, async_save=True)   # returns after host staging
    ...                                                       # train on; the write goes on
    ckpt.finalize()                                           # wait, then commit (rename)
    ckpt.load(weights_dir, optimizer_dir)                     # weights, state, counters

Sync and async saves are one path: the same write requests run inline or in a background thread,
so their files are identical. Every save is collective (all ranks call it); each directory is
written into a temporary sibling and renamed into place by rank 0 after every rank finished
(`checkpoint.commit`). The weights and the training state share a `save_id`, so a load refuses an
optimizer directory from another save.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import CheckpointException

from policyworker.checkpoint import integrity
from policyworker.checkpoint import state as sd
from policyworker.checkpoint.commit import (
    CheckpointError,
    check_model,
    commit,
    fault_point,
    file_sizes,
    from_rank0,
    gather,
    make_tmp,
    model_fields,
    rank,
    read_manifest,
    write_manifest,
)
from policyworker.checkpoint.writes import (
    PendingSave,
    failure,
    first_error,
    join_writes,
    start_writes,
)
from policyworker.compat.checkpoint import in_process_write_results
from policyworker.config import OptimizerConfig, SchedulerConfig
from policyworker.memory.host import HostArena
from policyworker.model.hf_config import ModelShape
from policyworker.parallel.dims import Groups, ParallelDims
from policyworker.train.optimizer import restore_schedule

log = logging.getLogger(__name__)

HF_SUBDIR = "hf"
"""Inside a weights checkpoint: the HF config (and tokenizer files), for export."""


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
    optimizer_config: OptimizerConfig
    scheduler_config: SchedulerConfig
    refit: Versioned
    """What holds the version of the last refit (saved, and restored by a load)."""


class Versioned(Protocol):
    version: int


_UNFINISHED: set[Checkpointer] = set()
"""Checkpointers with an async save pending, kept alive — with the model and optimizer state
their save reads — until it is committed, at the latest at exit (`finalize_unfinished`): a
worker collected before exit (made inside `main()`, or `del`-eted) lost its save."""


def finalize_unfinished() -> None:
    """Commit every pending async save (a failed one is removed, with a warning); at exit."""
    for checkpointer in list(_UNFINISHED):
        checkpointer.close()


class Checkpointer:
    """One rank's checkpoint I/O; holds at most one unfinished async save."""

    def __init__(self, trainee: Trainee, *, verify_integrity: bool, writer_threads: int) -> None:
        self.t = trainee
        self.verify_integrity = verify_integrity
        self.writer_threads = writer_threads
        # One save strategy per directory kind, kept: after the first save megatron reuses its
        # plans, and the sharding is validated once (the model's sharding does not change).
        self._strategies: dict[str, TorchDistSaveShardedStrategy] = {}
        self._pending: PendingSave | None = None
        self._arena: HostArena | None = None  # staging memory, reused by every save
        self.damaged: str | None = None
        """Why the training state is unusable (a load failed part-way through applying it);
        cleared by the next load with a training state."""
        self.last_save_timing: dict[str, float] = {}
        """The last save's bytes staged and seconds since its call when: the sharded state dicts
        were built, the host copies issued (a first save allocates their memory), the write
        planned, the copies done."""

    def require_intact(self, call: str) -> None:
        """Raise `CheckpointError` while a part-way load has left the training state unusable."""
        if self.damaged is not None:
            raise CheckpointError(f"{call}: {self.damaged}; load a full checkpoint")

    # --- save ------------------------------------------------------------------------------------

    def save(
        self,
        weights_path: Path,
        optimizer_path: Path | None,
        *,
        tokenizer: Any | None,
        async_save: bool,
        tokenizer_path: Path | None = None,
    ) -> None:
        """Stage to the host and plan the write; write inline (sync) or in the background.
        `tokenizer_path`: the tokenizer saved there too, at once (rank 0)."""
        self.finalize()  # a second save waits for the first
        start = time.perf_counter()
        t = self.t
        save_id = uuid.uuid4().hex if rank() == 0 else ""
        save_id = from_rank0(lambda: save_id)
        base = {
            "save_id": save_id,
            "step": 0 if t.scheduler is None else int(t.scheduler.num_steps),
            "weight_version": t.refit.version,
            "model": model_fields(t.shape),
            "precision": t.precision,
            "layout": manifest_layout(t),
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
        pending = PendingSave(requests=[], commits=[])
        try:
            self._plan(pending, trees, tokenizer)
            planned_s = time.perf_counter() - start
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the staging copies, which the planning overlapped
        except BaseException as e:
            raise failure(pending, e) from e
        done_s = time.perf_counter() - start
        self.last_save_timing = dict(
            state_dicts_s=trees_s, stage_s=staged_s, planned_s=planned_s, staged_s=done_s
        ) | {"staged_bytes": float(staged)}
        self._pending = pending
        _UNFINISHED.add(self)
        start_writes(pending)
        if not async_save:
            self.finalize()
        if tokenizer_path is not None and rank() == 0:
            tokenizer.save_pretrained(tokenizer_path)
        self.last_save_timing["blocking_s"] = time.perf_counter() - start

    def _plan(
        self,
        pending: PendingSave,
        trees: list[tuple[Path, dict[str, Any], dict[str, Any]]],
        tokenizer: Any | None,
    ) -> None:
        """Each directory's temporary sibling and write request (into `pending` as they are
        made, so a failure can remove what exists)."""
        for target, tree, meta in trees:
            tmp = make_tmp(target)
            pending.tmps.append(tmp)
            pending.commits.append((tmp.path, target, meta))
            first = meta["kind"] not in self._strategies
            strategy = self._strategies.setdefault(
                meta["kind"],
                TorchDistSaveShardedStrategy(
                    thread_count=self.writer_threads, cached_metadata=True
                ),
            )
            with in_process_write_results():
                request = dist_checkpointing.save(
                    tree,
                    str(tmp.path),
                    sharded_strategy=strategy,
                    validate_access_integrity=first,
                    async_sharded_save=True,
                    async_strategy="mcore",
                )
            # Not request.preload_fn: the tensors are on the host already, and it synchronizes
            # the device (which would end the overlap with the staging copies).
            pending.requests.append((request, list(request.async_fn_args)))
        if rank() == 0:
            _write_hf_files(pending.commits[0][0], self.t.hf_config, tokenizer)

    @property
    def pending_targets(self) -> list[Path]:
        """The directories of the async save not yet finalized."""
        return [] if self._pending is None else [c[1] for c in self._pending.commits]

    def finalize(self) -> bool:
        """Wait for an async save's writes, finish it on every rank and commit it. Returns
        whether there was one. Collective. A save that fails commits nothing and leaves no
        temporary files: `CheckpointSaveError` names the directory and the cause."""
        pending, self._pending = self._pending, None
        _UNFINISHED.discard(self)
        if pending is None:
            return False
        try:
            self._commit(pending)
        except BaseException as e:
            raise failure(pending, e) from e
        return True

    def close(self) -> None:
        """`finalize`, with a failure logged (the failed save removed) instead of raised."""
        try:
            self.finalize()
        except Exception as e:
            log.warning("shutdown: the pending async save was not committed: %s", e)

    def _commit(self, pending: PendingSave) -> None:
        join_writes(pending)
        failures = [
            f"rank {r}: {e}" for r, e in enumerate(gather(first_error(pending.errors))) if e
        ]
        if failures:
            raise RuntimeError(f"the write failed ({'; '.join(failures)})")
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

    # --- load ------------------------------------------------------------------------------------

    def load(self, weights_path: Path, optimizer_path: Path | None) -> dict[str, Any]:
        """Load a checkpoint into the live model (and optimizer, scheduler, RNG) and the refit
        version it was saved at; returns the weights manifest. Every check and every read
        happens before a live tensor changes."""
        t = self.t
        self.finalize()
        manifest = read_manifest(weights_path, "weights_path")
        _check_kind(manifest, "weights", "weights_path", weights_path)
        check_model(manifest, t.shape, "weights_path")
        opt_manifest = None
        if optimizer_path is not None:
            opt_manifest = read_manifest(optimizer_path, "optimizer_path")
            _check_kind(opt_manifest, "training_state", "optimizer_path", optimizer_path)
            if opt_manifest.get("save_id") != manifest.get("save_id"):
                raise CheckpointError(
                    f"optimizer_path: {optimizer_path} was written by another save than "
                    f"weights_path {weights_path} (save_id differs)"
                )
            _check_optimizer(opt_manifest, t)
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
        try:
            _apply(t, loaded, opt_loaded)
        except BaseException as e:
            self.damaged = f"loading {weights_path} failed part-way ({type(e).__name__}: {e})"
            raise CheckpointError(
                f"{self.damaged}; the training state is partly replaced: load a checkpoint with "
                "its optimizer_path before training again"
            ) from e
        if opt_loaded is not None:
            self.damaged = None
        t.refit.version = int(manifest["weight_version"])
        return manifest


def manifest_layout(t: Trainee) -> dict[str, int]:
    return {"tp": t.dims.tp, "pp": t.dims.pp, "cp": t.dims.cp, "dp": t.dims.dp}


def _check_kind(manifest: dict[str, Any], kind: str, field: str, folder: Path) -> None:
    if manifest.get("kind") != kind:
        other = "optimizer_path" if field == "weights_path" else "weights_path"
        raise CheckpointError(
            f"{field}: {folder} holds a checkpoint's {manifest.get('kind')!r} directory, not its "
            f"{kind!r} one (pass it as {other}?)"
        )


def _check_optimizer(opt_manifest: dict[str, Any], t: Trainee) -> None:
    """Refuse a training state this worker's optimizer cannot take, before anything loads: its
    state has another form under another precision (fp32 masters or none) or optimizer kind."""
    saved_dist, live_dist = opt_manifest.get("distributed_optimizer"), _is_dist(t)
    if saved_dist != live_dist:
        kinds = {True: "a distributed optimizer", False: "a plain optimizer"}
        raise CheckpointError(
            f"optimizer_path: saved by {kinds.get(saved_dist, saved_dist)}; this worker has "
            f"{kinds[live_dist]} (optimizer.use_distributed_optimizer={live_dist}). Load the "
            "weights alone, or use the optimizer kind it was saved with"
        )
    if opt_manifest.get("precision") != t.precision:
        raise CheckpointError(
            f"optimizer_path: saved by a {opt_manifest.get('precision')} worker; this one is "
            f"{t.precision}, whose optimizer state has another form. Load the weights alone, or "
            f"use precision={opt_manifest.get('precision')!r}"
        )


def _load(tree: dict[str, Any], folder: Path, manifest: dict[str, Any], field: str) -> Any:
    if "sha256" in manifest:
        integrity.verify(folder, manifest["sha256"], field)
    try:
        return dist_checkpointing.load(tree, str(folder))
    # dist-checkpointing raises many types, torch's CheckpointException a BaseException
    except (Exception, CheckpointException) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{field}: {folder} does not load: {reason[:500]}") from e


def _apply(t: Trainee, loaded: Any, opt_loaded: Any | None) -> None:
    """Copy loaded host tensors into the live optimizer, scheduler, model and RNG (the
    optimizer first: it is the part whose load can still refuse what it is given)."""
    if opt_loaded is not None:
        sd.load_optimizer(t.optimizer, opt_loaded["optimizer"])
        overridden = restore_schedule(
            t.optimizer,
            t.scheduler,
            opt_loaded["scheduler"],
            t.optimizer_config,
            t.scheduler_config,
        )
        if overridden:
            log.warning(
                "load_checkpoint: the checkpoint's settings replace the config's "
                "(set_learning_rate() after the load changes the lr): %s",
                overridden,
            )
    t.model.load_state_dict(loaded, strict=False)
    if opt_loaded is None:
        _reseed_masters(t.optimizer)
    elif "rng" in opt_loaded:
        sd.restore_rng(opt_loaded["rng"])


def _reseed_masters(optimizer: Any | None) -> None:
    """Weights loaded without optimizer state: the fp32 masters must follow the new weights."""
    if optimizer is not None:
        optimizer.reload_model_params()


def _is_dist(t: Trainee) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from policyworker.train.optimizer import optimizer_parts

    return any(isinstance(p, DistributedOptimizer) for p in optimizer_parts(t.optimizer))


def _write_hf_files(folder: Path, hf_config: Any, tokenizer: Any | None) -> None:
    hf = folder / HF_SUBDIR
    hf.mkdir(exist_ok=True)
    hf_config.save_pretrained(hf)
    if tokenizer is not None:
        tokenizer.save_pretrained(hf)
