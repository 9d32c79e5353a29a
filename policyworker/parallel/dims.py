"""Parallel layout: the sizes, explicit, and the one place megatron's `parallel_state` is set up.

Ranks are laid out as megatron orders them (tp fastest, then cp, then dp, then pp), which is the
named mesh `[pp, dp, cp, tp]` that NeMo-RL uses.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from policyworker.config import ParallelConfig

log = logging.getLogger(__name__)


AXES = ("pp", "dp", "cp", "tp")
"""The mesh's axes, slowest first: megatron's rank order (tensor parallel fastest)."""
_FIELDS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelDims:
    """Sizes of each parallel axis, and the world's ranks as the mesh `[pp, dp, cp, tp]`.
    `dp` is derived: world / (tp * pp * cp). The experts of an MoE layer lie on a grid of their
    own over the same ranks (megatron's): `ep` ranks hold different experts, each split over
    `etp` ranks; etp * ep * pp divides the world.

        dims = ParallelDims.from_world(world_size=8, tp=2, pp=2, cp=1, ep=1)
        dims.coords(5)                  # {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
        dims.ranks_along("tp", 5)       # [4, 5]
        dims.replica(1)                 # every rank holding data-parallel shard 1
        dims.leader(1)                  # the one whose outputs a driver keeps (last stage)
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    sp: bool = False
    """Sequence parallelism: activations outside attention and MLP split along the sequence over
    the TP group (needs tp > 1)."""

    @classmethod
    def from_world(
        cls,
        *,
        world_size: int,
        tp: int,
        pp: int,
        cp: int,
        ep: int = 1,
        etp: int = 1,
        sp: bool = False,
        world_field: str = "WORLD_SIZE",
    ) -> ParallelDims:
        """The layout of `world_size` ranks (`world_field` names where that number came from)."""
        for axis, size in {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp}.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"parallel.{_FIELDS[axis]}: expected an int >= 1, got {size!r}")
        model_parallel = tp * pp * cp
        if not isinstance(world_size, int) or world_size < 1 or world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} ({world_field}): expected a multiple of tp*pp*cp = "
                f"{tp}*{pp}*{cp} = {model_parallel}"
            )
        if world_size % (etp * ep * pp):
            raise ValueError(
                f"world size {world_size} ({world_field}): expected a multiple of etp*ep*pp = "
                f"{etp}*{ep}*{pp} = {etp * ep * pp} (the experts' grid)"
            )
        return cls(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=world_size // model_parallel, sp=sp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def sequence_multiple(self) -> int:
        """What every micro-batch's sequence length must be a multiple of (TP with SP)."""
        return self.tp if self.sp else 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's sizes along `AXES`."""
        return tuple(getattr(self, axis) for axis in AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of `rank` along each axis of `AXES`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        out: dict[str, int] = {}
        for axis, size in reversed(list(zip(AXES, self.shape, strict=True))):
            rank, out[axis] = divmod(rank, size)
        return {axis: out[axis] for axis in AXES}

    def rank(self, **coords: int) -> int:
        """The rank at `coords` (an axis left out is 0)."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; expected some of {AXES}")
        rank = 0
        for axis, size in zip(AXES, self.shape, strict=True):
            c = coords.get(axis, 0)
            if not 0 <= c < size:
                raise ValueError(f"{axis}: coordinate {c} outside [0, {size})")
            rank = rank * size + c
        return rank

    def ranks_along(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from `rank` only along `axis` (its group on that axis)."""
        if axis not in AXES:
            raise ValueError(f"axis: expected one of {AXES}, got {axis!r}")
        coords = self.coords(rank)
        return [self.rank(**{**coords, axis: i}) for i in range(getattr(self, axis))]

    def replica(self, dp_rank: int) -> list[int]:
        """The ranks (TP x CP x PP) that hold data-parallel shard `dp_rank`."""
        return [r for r in range(self.world_size) if self.coords(r)["dp"] == dp_rank]

    def leader(self, dp_rank: int) -> int:
        """The rank whose outputs stand for replica `dp_rank`: its first on the last pipeline
        stage (which alone holds what is not broadcast to the others, e.g. a full payload)."""
        return self.rank(dp=dp_rank, pp=self.pp - 1)


_LOWEST_PORT = 20000
"""Ports below this are left to services; free_port picks from here up to the ephemeral range."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local end of outgoing connections (Linux's default if unknown)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now, for a server another process binds a moment later.

    bind(0) hands out a port of the ephemeral range, which the kernel also gives every outgoing
    connection's local end (gloo's mesh and each store client open many): one of them can take
    the port before the server binds it (a test run met EADDRINUSE so). A random port below that
    range is only ever taken by another listener; where the range leaves no room, bind(0).
    """
    low, _ = _ephemeral_range()
    choose = random.SystemRandom()  # not the seeded `random`: seeded processes would all agree
    if low - _LOWEST_PORT >= 1000:
        for _ in range(100):
            port = choose.randrange(_LOWEST_PORT, low)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_distributed(*, timeout_s: float = 600.0) -> None:
    """Start torch.distributed if nobody has: gloo on CPU, NCCL on GPU, single process by default.

    torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) are honoured.
    Rank 0's rendezvous store listens on MASTER_ADDR only (torch's own would listen on every
    interface); under torchrun, torchrun's store is used (docs/deployment.md: the ports).
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
    timeout = datetime.timedelta(seconds=timeout_s)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # its agent hosts the store
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = None if under_torchrun else tcp_store(host, port, world, rank == 0, timeout)
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world, timeout=timeout, store=store
    )
    log.info("torch.distributed up: backend=%s rank=%d world=%d", backend, rank, world)


def tcp_store(
    host: str, port: int, world: int, is_master: bool, timeout: datetime.timedelta
) -> dist.TCPStore:
    """A TCPStore at host:port; its master listens on a socket bound to `host` alone (handed
    to the store, which owns it from then on) — torch's own listens on every interface."""
    listen_fd = None
    if is_master:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        server = socket.socket(family, kind, proto)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(address)
            server.listen(2048)
        except OSError:
            server.close()
            raise
        listen_fd = server.detach()
    return dist.TCPStore(host, port, world, is_master, timeout, master_listen_fd=listen_fd)


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
            etp=parallel_state.get_expert_tensor_parallel_world_size(),
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
        expert_tensor_parallel_size=dims.etp,
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
    ep: dist.ProcessGroup
    """Expert parallel: ranks holding different experts of the same layers."""
    etp: dist.ProcessGroup
    """Expert tensor parallel: ranks holding parts of the same experts."""
    tp_rank: int
    dp_rank: int
    cp_rank: int
    cp_size: int
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int
    etp_rank: int
    etp_size: int
    expert_dp_rank: int
    """Rank among the ranks holding the same experts (expert data parallel)."""
    pp_last_rank: int
    """Global rank of this pipeline's last stage: the one that holds logits and losses."""
    is_first_stage: bool
    is_last_stage: bool

    @property
    def leads_replica(self) -> bool:
        """The first of its pipeline stage's TP x CP ranks in data-parallel replica 0: the rank
        that writes what the stage holds once (e.g. its part of an HF export)."""
        return self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0

    @classmethod
    def current(cls) -> Groups:
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            dp=ps.get_data_parallel_group(),
            cp=ps.get_context_parallel_group(),
            mp=ps.get_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
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
        etp=parallel.expert_tensor_parallel_size,
        sp=parallel.sequence_parallel,
    )
    init_model_parallel(dims)
    _destroy_at_exit()
    return dims, Groups.current()


@functools.cache
def _destroy_at_exit() -> None:
    """Register `destroy_parallel` at interpreter exit, once per process."""
    atexit.register(destroy_parallel)


def destroy_parallel() -> None:
    """megatron's groups and torch.distributed's, destroyed (run at interpreter exit: a process
    that leaves them to the C++ destructors can abort at exit, "terminate called without an
    active exception", after its work is done)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
