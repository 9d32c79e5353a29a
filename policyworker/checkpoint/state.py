"""What a distributed checkpoint holds, as megatron-core sharded state dicts.

A checkpoint is two dist-checkpointing (torch_dist) directories: the weights (the model's sharded
state dict) and, optionally, the training state (the optimizer's sharded state dict — fp32 masters
and Adam moments, plain or distributed optimizer — plus the scheduler, the RNG states and the
step counters). Sharded tensors carry global shapes and offsets, so a checkpoint loads into any
parallel layout that megatron can describe (dist-checkpointing reshards on load).

Saving works on a host copy (`stage`): the caller may change the live tensors as soon as `stage`
returns, which is what lets an async save return before the disk write. Loading reads into fresh
host tensors (`fresh`) and only then copies into the live ones, so a checkpoint that fails to load
changes no weight.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from policyworker.memory.host import HostArena
from policyworker.parallel.dims import Groups, ParallelDims
from policyworker.train.optimizer import optimizer_parts

StateDict = dict[str, Any]


def model_state(model: torch.nn.Module) -> StateDict:
    """The model's sharded state dict (global names, TP/PP shards with their global offsets)."""
    return model.sharded_state_dict()


def optimizer_state(optimizer: Any, model_sd: StateDict, *, is_loading: bool) -> StateDict:
    """The optimizer's sharded state dict, keyed like the model's (reshardable in model space,
    also for the distributed optimizer)."""
    complete_adam_state(optimizer)
    # The distributed optimizer's default format in megatron-core 0.19 ("fully_sharded_model_space")
    # is deprecated and fails there; "fully_reshardable" loads into any TP/PP/DP layout.
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)


def load_optimizer(optimizer: Any, loaded: Any) -> None:
    """Load an optimizer state dict (from `optimizer_state`) into the live optimizer."""
    parts = optimizer_parts(optimizer)
    if len(parts) == 1:
        states = [loaded]
    elif isinstance(loaded, dict):
        states = [v for _, v in sorted(loaded.items())]
    else:
        states = list(loaded)
    for part, state in zip(parts, states, strict=True):
        _default_step(state)
        _align_lr_range(part, state)
        if isinstance(part, DistributedOptimizer):
            _load_distributed(part, state)
        else:
            part.load_state_dict(state)
    complete_adam_state(optimizer)


def _load_distributed(part: DistributedOptimizer, state: dict[str, Any]) -> None:
    """`DistributedOptimizer.load_state_dict`, in its two halves: megatron-core 0.19 without
    TE/apex keeps torch Adam's per-parameter `step` tensor in the optimizer state, which its
    "fully_reshardable" loader then expects in the checkpoint's tensors (KeyError). The steps
    are set aside while the tensors load, and put back."""
    param_state = state.pop("param_state")
    kind = state.pop("param_state_sharding_type")
    if kind != "fully_reshardable":
        raise ValueError(
            f"distributed optimizer state of type {kind!r}; expected fully_reshardable"
        )
    part.load_state_dict(state)  # param groups, and the shared step (set on every parameter)
    inner = part.optimizer.state
    steps = {p: inner[p].pop("step") for p in list(inner) if "step" in inner[p]}
    try:
        part.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            inner[p]["step"] = step
    # megatron hands every parameter the same step tensor; fused Adam increments each
    # parameter's step in place, so each must own its tensor
    for p in inner:
        if torch.is_tensor(inner[p].get("step")):
            inner[p]["step"] = inner[p]["step"].clone()


def _align_lr_range(part: Any, tree: Any) -> None:
    """megatron matches saved to live parameter groups by a key that includes each group's
    max_lr and min_lr, which `set_learning_rate` changes during a run; take the saved ones (the
    scheduler state restores them anyway), pairing groups in order."""
    saved = _param_groups(tree)
    live = part.optimizer.param_groups
    if saved is None or len(saved) != len(live):
        return
    for group, saved_group in zip(live, saved, strict=True):
        for key in ("max_lr", "min_lr"):
            if key in saved_group:
                group[key] = saved_group[key]


def _param_groups(tree: Any) -> list[dict[str, Any]] | None:
    if isinstance(tree, dict):
        if isinstance(tree.get("param_groups"), list):
            return tree["param_groups"]
        for value in tree.values():
            found = _param_groups(value)
            if found is not None:
                return found
    return None


def _default_step(tree: Any) -> None:
    """megatron saves Adam's shared step only when it is non-zero; a checkpoint taken before the
    first step restores step 0 (what `complete_adam_state` gave every parameter)."""
    if isinstance(tree, list):
        for item in tree:
            _default_step(item)
    elif isinstance(tree, dict):
        if "param_groups" in tree and isinstance(tree.get("state"), dict):
            tree["state"].setdefault("common_step", torch.zeros((), dtype=torch.float32))
        else:
            for value in tree.values():
                _default_step(value)


def rng_state(groups: Groups, dims: ParallelDims) -> ShardedObject:
    """This rank's RNG states (torch, CUDA, megatron's tracker), one object per model-parallel
    position; data-parallel replicas hold copies. Only a checkpoint of the same layout restores it."""
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        state,
        (dims.pp, dims.cp, dims.tp),
        (groups.pp_rank, groups.cp_rank, groups.tp_rank),
        replica_id=groups.dp_rank,
    )


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


@torch.no_grad()
def complete_adam_state(optimizer: Any) -> None:
    """Give every parameter the Adam state torch would create at its first step (zero moments,
    step 0), so a checkpoint taken before any step has the same keys as a later one. Numerically
    a no-op: Adam's first step reads exactly these values."""
    for part in optimizer_parts(optimizer):
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                state = part.optimizer.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "step" not in state:
                    # fused AdamW keeps its step as a float32 scalar on the parameter's device
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)


def stage(trees: list[StateDict], arena: HostArena | None) -> tuple[int, HostArena | None]:
    """Replace every sharded tensor's data in `trees` with a host copy; returns the bytes copied
    and the host arena that holds them (`arena` again when the sizes match, so a run's saves
    page-lock their staging memory once). Factories are applied first so that what is staged is
    what is written. The device-to-host copies are only issued: the caller synchronizes (and
    plans the write meanwhile) before it reads the host tensors or lets the live ones change."""
    found: list[ShardedTensor] = []

    def note(x: Any) -> Any:
        if isinstance(x, ShardedTensor) and x.data is not None:
            found.append(x)
        return x

    for tree in trees:
        apply_factories(tree)
        dict_list_map_inplace(note, tree)
    sizes = [x.data.numel() * x.data.element_size() for x in found]
    if arena is None or not arena.fits(sizes):
        arena = None  # the caller's one is dropped (freed) before the new one is allocated
        arena = HostArena(sizes, pin=torch.cuda.is_available())
    for i, x in enumerate(found):
        src = x.data.detach()
        host = arena.tensor(i, src.dtype, src.shape)
        host.copy_(src, non_blocking=True)
        x.data = host
    return sum(sizes), arena


def fresh(sd: StateDict) -> StateDict:
    """Point every sharded tensor (and factory) at a new, empty host tensor of its shape, so a
    load fills those and leaves the live tensors alone."""

    def empty(x: Any) -> Any:
        if isinstance(x, ShardedTensor | ShardedTensorFactory) and x.data is not None:
            x.data = torch.empty(x.data.shape, dtype=x.data.dtype, device="cpu")
        return x

    dict_list_map_inplace(empty, sd)
    return sd


def sharded_keys(sd: StateDict) -> list[str]:
    """The global keys of the sharded tensors in `sd` (for error messages)."""
    keys: list[str] = []

    def note(x: Any) -> Any:
        if isinstance(x, ShardedTensor | ShardedTensorFactory | ShardedObject):
            keys.append(x.key)
        return x

    dict_list_map_inplace(note, sd)
    return keys
