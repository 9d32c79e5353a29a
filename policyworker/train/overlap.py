"""megatron DDP's overlapped data-parallel communication, run so that nothing reads stale data.

`optimizer.overlap_param_gather` (with the distributed optimizer): the step updates only this
rank's shard of the parameters; the all-gather of the others' shards is left to the next
forward, whose pre-hooks gather each bucket just before its first module runs. Until then the
parameters outside this rank's shard are the previous step's. Forwards are fine (their hooks
gather); whatever reads parameters without a forward — refit, HF export, checkpoints, memory
moves, the reference-model swap — calls `sync_params()` first, and a step taken while the hooks
are disabled gathers at once (`after_step`), so a forward without hooks never reads stale
shards either.

`optimizer.overlap_grad_reduce`: the backward hooks reduce each bucket asynchronously once its
grads of the last micro-batch are in (megatron's schedule marks the last micro-batch). That is
right for `train()`, whose step is one schedule call; a streamed step (split-step training) is
several, so its chunks run with the hooks' reduce off (`deferred_grad_sync`) and `finish_step`
dispatches every bucket's reduce at once (`dispatch_grad_reduces`) before waiting for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Overlap:
    """The overlapped communication of one rank's DDP model (no-ops when it is off)."""

    def __init__(self, ddp: Any | None) -> None:
        self.ddp = ddp
        cfg = None if ddp is None else ddp.ddp_config
        self.grads = bool(cfg is not None and cfg.overlap_grad_reduce)
        self.params = bool(cfg is not None and cfg.overlap_param_gather)

    def _groups(self) -> list[Any]:
        return self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups

    @property
    def hooks_enabled(self) -> bool:
        return self.params and bool(self.ddp.remove_forward_pre_hook_handles)

    def params_pending(self) -> bool:
        """Whether a parameter all-gather is outstanding (not dispatched, or not waited for)."""
        return self.params and any(
            not g.param_gather_dispatched or g.param_gather_handle is not None
            for g in self._groups()
        )

    def sync_params(self) -> None:
        """Complete a pending parameter all-gather (collective over data parallelism)."""
        if self.params_pending():
            with torch.no_grad():
                self.ddp.start_param_sync(force_sync=True)

    def enable_hooks(self) -> None:
        """The forward pre-hooks that gather parameters (on after construction)."""
        self._require("enable_forward_pre_hook")
        if not self.hooks_enabled:
            self.ddp.enable_forward_pre_hook()

    def disable_hooks(self) -> None:
        """Remove the hooks; a pending gather is completed now (a forward without them would
        read stale shards), whatever the caller's `param_sync`."""
        self._require("disable_forward_pre_hook")
        if self.hooks_enabled:
            self.ddp.disable_forward_pre_hook(param_sync=False)
        self.sync_params()

    def after_step(self) -> None:
        """After an optimizer step: with the hooks off, gather the updated parameters now."""
        if self.params and not self.hooks_enabled:
            self.sync_params()

    @contextlib.contextmanager
    def deferred_grad_sync(self) -> Iterator[None]:
        """One chunk of a streamed step: the backward hooks dispatch no reduce (every
        micro-batch counts as not the last; megatron's schedule would mark its last one)."""
        if not self.grads:
            yield
            return
        config = self.ddp.config
        saved, config.no_sync_func = config.no_sync_func, contextlib.nullcontext
        try:
            with self.ddp.no_sync():
                yield
        finally:
            config.no_sync_func = saved

    def dispatch_grad_reduces(self) -> None:
        """Before a step's gradients are finalized: start every bucket's reduce that the hooks
        did not (a streamed step's, or buckets the backward left incomplete)."""
        if not self.grads:
            return
        for g in self._groups():
            if g.grad_reduce_handle is None and not g.grad_reduce_finished and not g.is_first_batch:
                g.start_grad_sync()

    def drain_grad_reduces(self) -> None:
        """Wait for reduces still in flight, before their buffers are zeroed (an abort)."""
        if not self.grads:
            return
        for g in self._groups():
            if g.grad_reduce_handle is not None:
                g.grad_reduce_handle.wait()
                g.grad_reduce_handle = None

    def _require(self, call: str) -> None:
        if not self.params:
            raise ValueError(
                f"{call}: optimizer.overlap_param_gather is off (no forward pre-hooks to switch)"
            )
