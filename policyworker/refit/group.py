"""The process group a refit runs over when trainer and engines sit on different devices (the
collective and reshard transports): joining it, and the collectives both transports build on —
each bounded by the group's timeout, a dead peer a `RefitError` naming the step, never a hang.

The group is separate from the trainer's own torch.distributed world (gloo on CPU, NCCL on GPU);
rank 0 is the trainer's sending rank and hosts the TCP store.
"""

from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist

from policyworker.parallel.dims import tcp_store
from policyworker.refit.layout import RefitError, RefitInfo, dtype_name


def join_refit_group(
    host: str, port: int, world_size: int, rank: int, *, device: torch.device, timeout_s: float
) -> dist.ProcessGroup:
    """This process's member of the refit group (rank 0 is the trainer and hosts the store)."""
    if not 0 <= rank < world_size or world_size < 2:
        raise ValueError(f"rank: expected 0 <= rank < world_size >= 2, got {rank}, {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = tcp_store(host, port, world_size, rank == 0, timeout)  # on `host` alone
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def fingerprint(info: RefitInfo) -> int:
    """63 bits of a hash of the refit info's names, shapes and dtypes, in order."""
    text = "|".join(f"{n}:{list(s)}:{dtype_name(d)}" for n, (s, d) in info.items())
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def start_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, what: str) -> dist.Work:
    """Broadcast `tensor` from the group's rank 0 (asynchronous: `wait_for` the work)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    try:
        return group.broadcast([tensor], opts)
    except RuntimeError as e:
        raise RefitError(f"refit: the collective failed at {what}: {e}") from None


def wait_for(work: dist.Work, what: str, timeout: datetime.timedelta) -> None:
    """Wait for a collective; a dead peer or the timeout is a `RefitError` naming `what`."""
    try:
        work.wait(timeout)
    except RuntimeError as e:  # a dead peer or the timeout
        raise RefitError(f"refit: the collective failed at {what}: {e}") from None


def agree(
    group: dist.ProcessGroup,
    ok: bool,
    device: torch.device,
    what: str,
    timeout: datetime.timedelta,
) -> bool:
    """Whether every member says `ok` (a MIN all-reduce)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    try:
        work = group.allreduce([flag], opts)
    except RuntimeError as e:
        raise RefitError(f"refit: the collective failed at {what}: {e}") from None
    wait_for(work, what, timeout)
    return bool(flag.item())
