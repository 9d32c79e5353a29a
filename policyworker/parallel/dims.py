"""Parallel layout: the sizes, explicit, and the one place megatron's `parallel_state` is set up.

Ranks are laid out as megatron orders them (tp fastest, then cp, then dp, then pp), which is the
named mesh `[pp, dp, cp, tp]` that NeMo-RL uses.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from policyworker.config import ParallelConfig
from policyworker.model.hf_config import ModelShape

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelDims:
    """Sizes of each parallel axis. `dp` is derived: world / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    sp: bool = False
    """Sequence parallelism: activations outside attention and MLP split along the sequence over
    the TP group (needs tp > 1)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @classmethod
    def from_world(
        cls, *, world_size: int, tp: int, pp: int, cp: int, ep: int, sp: bool = False
    ) -> ParallelDims:
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}"
            )
        return cls(tp=tp, pp=pp, cp=cp, ep=ep, dp=world_size // model_parallel, sp=sp)

    @property
    def sequence_multiple(self) -> int:
        """What every micro-batch's sequence length must be a multiple of (TP with SP)."""
        return self.tp if self.sp else 1


def check_layout(parallel: ParallelConfig, shape: ModelShape) -> None:
    """Refuse a layout this model cannot be split into, naming the config field.

    TP splits the heads, query groups and ffn (the vocabulary is padded to a multiple of TP);
    PP the layers.
    """
    field = "parallel.{}_size".format
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ep = parallel.expert_model_parallel_size
    if ep != 1:
        raise ValueError(f"{field('expert_model_parallel')}: expected 1 (dense models), got {ep}")
    if parallel.sequence_parallel and tp == 1:
        raise ValueError("parallel.sequence_parallel: needs tensor_model_parallel_size > 1")
    tp_split = {
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.ffn_hidden_size,
    }
    for name, size in tp_split.items():
        if size % tp:
            raise ValueError(
                f"{field('tensor_model_parallel')}: expected a divisor of {name}={size}, got {tp}"
            )
    if shape.num_layers % pp:
        raise ValueError(
            f"{field('pipeline_model_parallel')}: expected a divisor of "
            f"num_layers={shape.num_layers}, got {pp}"
        )


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(*, timeout_s: float = 600.0) -> None:
    """Start torch.distributed if nobody has: gloo on CPU, NCCL on GPU, single process by default.

    torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) are honoured.
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    log.info("torch.distributed up: backend=%s rank=%d world=%d", backend, rank, world)


def init_model_parallel(dims: ParallelDims) -> None:
    """Create megatron's process groups for `dims` (once per process; a mismatch is an error)."""
    from megatron.core import parallel_state

    if dims.world_size != dist.get_world_size():
        raise ValueError(
            f"parallel layout {dims} needs {dims.world_size} ranks, world has {dist.get_world_size()}"
        )
    if parallel_state.model_parallel_is_initialized():
        current = ParallelDims(
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            pp=parallel_state.get_pipeline_model_parallel_world_size(),
            cp=parallel_state.get_context_parallel_world_size(),
            ep=parallel_state.get_expert_model_parallel_world_size(),
            dp=parallel_state.get_data_parallel_world_size(),
            sp=dims.sp,  # a mode of the TP group, not a process group of its own
        )
        if current != dims:
            raise ValueError(f"megatron is already initialized with {current}, asked for {dims}")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
    )


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's process groups and coordinates, read from megatron once."""

    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    """Data parallel without CP: ranks that hold different data."""
    cp: dist.ProcessGroup
    mp: dist.ProcessGroup
    pp: dist.ProcessGroup
    tp_rank: int
    dp_rank: int
    cp_rank: int
    cp_size: int
    pp_rank: int
    pp_size: int
    pp_last_rank: int
    """Global rank of this pipeline's last stage: the one that holds logits and losses."""
    is_first_stage: bool
    is_last_stage: bool

    @classmethod
    def current(cls) -> Groups:
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            dp=ps.get_data_parallel_group(),
            cp=ps.get_context_parallel_group(),
            mp=ps.get_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
            is_first_stage=ps.is_pipeline_first_stage(),
            is_last_stage=ps.is_pipeline_last_stage(),
        )


def broadcast_from_last_stage(
    tensor: torch.Tensor, groups: Groups, *, device: torch.device
) -> torch.Tensor:
    """The last pipeline stage's `tensor` (same shape and dtype everywhere) on every stage.

    Sent through `device` (NCCL moves CUDA tensors only); returned where `tensor` was.
    """
    if groups.pp_size == 1:
        return tensor
    sent = tensor.to(device)
    dist.broadcast(sent, src=groups.pp_last_rank, group=groups.pp)
    return sent.to(tensor.device)


def broadcast_object_from_last_stage(obj: object, groups: Groups) -> object:
    """The last pipeline stage's picklable `obj` (e.g. a metrics dict) on every stage."""
    if groups.pp_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=groups.pp_last_rank, group=groups.pp)
    return box[0]


def setup_parallel(parallel: ParallelConfig) -> tuple[ParallelDims, Groups]:
    """torch.distributed (if nobody started it) and megatron's groups for `parallel`: this
    rank's sizes and groups."""
    init_distributed()
    dims = ParallelDims.from_world(
        world_size=dist.get_world_size(),
        tp=parallel.tensor_model_parallel_size,
        pp=parallel.pipeline_model_parallel_size,
        cp=parallel.context_parallel_size,
        ep=parallel.expert_model_parallel_size,
        sp=parallel.sequence_parallel,
    )
    init_model_parallel(dims)
    if not _EXIT_HOOK:
        atexit.register(destroy_parallel)
        _EXIT_HOOK.append(True)
    return dims, Groups.current()


_EXIT_HOOK: list[bool] = []


def destroy_parallel() -> None:
    """megatron's groups and torch.distributed's, destroyed (run at interpreter exit: a process
    that leaves them to the C++ destructors can abort at exit, "terminate called without an
    active exception", after its work is done)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
