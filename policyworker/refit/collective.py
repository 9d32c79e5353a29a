"""Refit by collective broadcast: trainer and engines on different devices, one process group.

Handshake: every member calls `join_refit_group(host, port, world_size, rank, ...)` — the
trainer's sending rank is rank 0 (it hosts the TCP store), receivers take 1..world_size-1. The
group is separate from the trainer's own torch.distributed world (gloo on CPU, NCCL on GPU).

One refit, all members in step:

    header   int64 [version, bucket_bytes, checksum on, info fingerprint]   broadcast from 0
    verdict  MIN all-reduce of "my refit info matches"                        (a mismatch: all raise)
    buckets  uint8, cut from the refit info by both sides alike, broadcast from 0 through
             `num_buffers` buffers (bucket k+1 is packed while bucket k is in flight); with the
             checksum on, each bucket's checksum follows it
    verdict  MIN all-reduce of "staged, verified and applied"                 (so the trainer knows)

Every collective has the group's timeout: a dead peer is an error on the others, not a hang.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from policyworker.refit.group import agree, fingerprint, start_broadcast, wait_for
from policyworker.refit.layout import (
    Layout,
    RefitError,
    RefitInfo,
    RefitReport,
    bucket_header,
    checksum_on_device,
    pack,
)
from policyworker.refit.receiver import Staging


def broadcast_refit(
    group: dist.ProcessGroup,
    tensors: Iterator[tuple[str, torch.Tensor]],
    info: RefitInfo,
    *,
    version: int,
    bucket_bytes: int,
    num_buffers: int,
    use_checksum: bool,
    device: torch.device,
    timeout_s: float,
) -> RefitReport:
    """The trainer's side (group rank 0)."""
    start = time.perf_counter()
    timeout = datetime.timedelta(seconds=timeout_s)
    layout = Layout(info, bucket_bytes)
    header = [version, bucket_bytes, int(use_checksum), fingerprint(info)]
    head = torch.tensor(header, dtype=torch.int64, device=device)
    wait_for(start_broadcast(group, head, "the header"), "the header", timeout)
    if not agree(group, True, device, "the refit info check", timeout):
        raise RefitError("refit: a receiver's refit info differs from the trainer's")
    size = layout.buffer_bytes
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(num_buffers)]
    in_flight: list[list[dist.Work]] = [[] for _ in range(num_buffers)]
    for bucket in layout.buckets:
        slot = bucket.index % num_buffers
        for work in in_flight[slot]:  # the buffer's previous bucket has left
            wait_for(work, f"bucket {bucket.index - num_buffers}", timeout)
        own = bucket.nbytes > size
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device) if own else buffers[slot]
        pack(bucket, buf, tensors)
        works = [start_broadcast(group, buf[: bucket.nbytes], f"bucket {bucket.index}")]
        if use_checksum:
            total = checksum_on_device(buf[: bucket.nbytes]).reshape(1)  # no host round trip
            works.append(start_broadcast(group, total, f"bucket {bucket.index}'s checksum"))
        if own:  # its buffer is used once: wait here rather than keep it
            for work in works:
                wait_for(work, f"bucket {bucket.index}", timeout)
            works = []
        in_flight[slot] = works
    for works in in_flight:
        for work in works:
            wait_for(work, "the last buckets", timeout)
    if not agree(group, True, device, "the end of the refit", timeout):
        raise RefitError("refit: a receiver rejected the refit (its weights are unchanged)")
    return RefitReport.of(layout, version, time.perf_counter() - start, use_checksum)


def receive_refit(
    group: dist.ProcessGroup, staging: Staging, *, device: torch.device, timeout_s: float
) -> int:
    """A receiver's side: one refit into `staging`; returns its version. Raises `RefitError`
    with the live weights unchanged when anything fails."""
    timeout = datetime.timedelta(seconds=timeout_s)
    head = torch.zeros(4, dtype=torch.int64, device=device)
    wait_for(start_broadcast(group, head, "the header"), "the header", timeout)
    version, bucket_bytes, use_checksum, theirs = head.tolist()
    mine = fingerprint(staging.layout.info)
    if not agree(group, theirs == mine, device, "the refit info check", timeout):
        raise RefitError(
            "refit: the trainer's refit info differs from this receiver's (or "
            "another receiver's); the live weights are unchanged"
        )
    layout = Layout(staging.layout.info, bucket_bytes)
    staging.begin(version)
    ok, error = True, ""
    for bucket in layout.buckets:
        data = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        wait_for(
            start_broadcast(group, data, f"bucket {bucket.index}"),
            f"bucket {bucket.index}",
            timeout,
        )
        total = None
        if use_checksum:
            t = torch.zeros(1, dtype=torch.int64, device=device)
            wait_for(
                start_broadcast(group, t, "a checksum"),
                f"bucket {bucket.index}'s checksum",
                timeout,
            )
            total = int(t.item())
        if ok:
            try:
                staging.stage(bucket_header(bucket, version, total), data)
            except RefitError as e:  # keep receiving: the others are still in the collective
                ok, error = False, str(e)
    if ok:
        try:
            staging.commit(version)
        except RefitError as e:
            ok, error = False, str(e)
    agree(group, ok, device, "the end of the refit", timeout)
    if not ok:
        raise RefitError(error)
    return version
