"""The trainer's side of refit: one small source per transport, each over the same `RefitWeights`.

    IpcSource         a colocated receiver on this rank's private endpoint (`refit/ipc.py`)
    CollectiveSource  receivers in a NCCL/gloo group that trainer rank 0 joins (`collective.py`)
    ReshardSource     destination ranks in their own TP/EP layout (`reshard.py`); a
                      destination's source receives into staging tensors
    SparseSource      remote receivers over TCP, the elements changed since a baseline
                      (`sparse.py`)

Each is joined (where its transport has a group) and then sends; every rank of the trainer
calls them together, since a refit gathers TP and PP shards. `Refit` holds one of each.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from policyworker.refit.buffers import sweep_dead
from policyworker.refit.collective import broadcast_refit
from policyworker.refit.group import join_refit_group
from policyworker.refit.ipc import IpcLink, private_endpoint, release_endpoint, send_ipc
from policyworker.refit.layout import Layout, RefitInfo, RefitReport
from policyworker.refit.reshard import Member, ReshardGroup, report
from policyworker.refit.sparse import SparseCall, check_shard, finish, stream, take_baseline
from policyworker.refit.sparse import SparseSource as Baseline
from policyworker.refit.weights import RefitWeights, check_refit_args


class IpcSource:
    """Refits the receiver that connects to `address` (ZMQ IPC, this rank's private folder)."""

    def __init__(self, weights: RefitWeights) -> None:
        self.weights = weights
        self.address = private_endpoint(f"rank{dist.get_rank()}.sock")
        self.link = IpcLink(self.address)  # the receiver's staging areas, kept mapped
        self._layout: tuple[RefitInfo, Layout] | None = None  # the last one cut
        self._released = False
        sweep_dead()

    def send(
        self, *, buffer_size_bytes: int, refit_timeout_s: float | None, send: bool
    ) -> RefitReport | None:
        """Stream every weight to the receiver (if `send`; the other ranks only take part in
        the TP/PP gathers). Collective over the model-parallel group."""
        check_refit_args(buffer_size_bytes, refit_timeout_s)
        w = self.weights
        if not send:
            w.gather_only()
            return None
        report = send_ipc(
            w.tensors(),
            self._cut(w.info(), w.bucket_bytes(buffer_size_bytes)),
            link=self.link,
            version=w.version + 1,
            timeout_s=w.timeout(refit_timeout_s),
            use_checksum=w.cfg.checksum,
            device=w.device,
        )
        w.version = report.version
        return report

    def _cut(self, info: RefitInfo, size: int) -> Layout:
        """The buckets of `info` at `size` (cut again only when either changed: Python over
        every tensor)."""
        if (
            self._layout is None
            or self._layout[0] is not info
            or self._layout[1].bucket_bytes != size
        ):
            self._layout = (info, Layout(info, size))
        return self._layout[1]

    def close(self) -> None:
        """Remove the endpoint's files (idempotent)."""
        self.link.reset()
        if not self._released:
            self._released = True
            release_endpoint(self.address)


class CollectiveSource:
    """Refits the receivers of a collective group, which trainer rank 0 joins as its rank 0; the
    other trainer ranks only take part in the gathers."""

    def __init__(self, weights: RefitWeights) -> None:
        self.weights = weights
        self.joined = False
        self._group: dist.ProcessGroup | None = None  # rank 0's

    def join(self, host: str, port: int, world_size: int, refit_timeout_s: float | None) -> None:
        """Rank 0 joins the group (blocks until every receiver has joined)."""
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size: expected an int >= 2, got {world_size!r}")
        check_refit_args(0, refit_timeout_s)
        w = self.weights
        if dist.get_rank() == 0:
            timeout = w.timeout(refit_timeout_s)
            self._group = join_refit_group(
                host, port, world_size, 0, device=w.device, timeout_s=timeout
            )
        self.joined = True

    def send(
        self, *, buffer_size_bytes: int | None, num_buffers: int, refit_timeout_s: float | None
    ) -> RefitReport | None:
        """One collective refit (collective over the model-parallel group too); rank 0 returns
        the report."""
        check_refit_args(buffer_size_bytes or 0, refit_timeout_s, num_buffers)
        if not self.joined:
            raise ValueError("broadcast_weights_for_collective: init_collective() first")
        w = self.weights
        if self._group is None:
            w.gather_only()
            return None
        report = broadcast_refit(
            self._group,
            w.tensors(),
            w.info(),
            version=w.version + 1,
            bucket_bytes=w.bucket_bytes(buffer_size_bytes),
            num_buffers=num_buffers,
            use_checksum=w.cfg.checksum,
            device=w.device,
            timeout_s=w.timeout(refit_timeout_s),
        )
        w.version = report.version
        return report


class ReshardSource:
    """Refits destination ranks in their own layout (a trainer rank sends, a destination rank
    receives into staging tensors and applies them only when the refit is complete)."""

    def __init__(self, weights: RefitWeights, *, destination: bool) -> None:
        self.weights, self.destination = weights, destination
        self._group: ReshardGroup | None = None
        self._staging: dict[str, torch.Tensor] | None = None  # a destination's, made once

    @property
    def joined(self) -> bool:
        return self._group is not None

    def join(
        self, host: str, port: int, sources: int, destinations: int, refit_timeout_s: float | None
    ) -> None:
        """Join the reshard group as a trainer rank (0..sources-1) or a destination rank."""
        check_refit_args(0, refit_timeout_s)
        w, g, destination = self.weights, self.weights.groups, self.destination
        if w.mxfp8:
            raise ValueError(
                "init_reshard: refit prequantization is on (enable_refit_prequantize); reshard "
                "members exchange megatron weights in the training dtype"
            )
        mine, world = (destinations, "destinations") if destination else (sources, "sources")
        if mine != dist.get_world_size():
            raise ValueError(
                f"{world}: expected this group's world size {dist.get_world_size()}, got {mine}"
            )
        if g.pp_size > 1:
            raise ValueError(
                "nccl_reshard_refit: expected pipeline_model_parallel_size 1 on both sides"
            )
        me = Member(
            rank=dist.get_rank() + (sources if destination else 0),
            destination=destination,
            tp_rank=g.tp_rank,
            tp_size=dist.get_world_size(g.tp),
            sends=not destination and g.dp_rank == 0 and g.cp_rank == 0,
            etp_rank=g.etp_rank,
            etp_size=g.etp_size,
            ep_rank=g.ep_rank,
            ep_size=g.ep_size,
            sends_experts=not destination and g.expert_dp_rank == 0,
        )
        self._group = ReshardGroup(
            host,
            port,
            sources=sources,
            destinations=destinations,
            me=me,
            device=w.device,
            timeout_s=w.timeout(refit_timeout_s),
        )

    def send(self, *, refit_timeout_s: float | None) -> RefitReport | int | None:
        """One reshard refit; the trainer's rank 0 returns the report, a destination the
        version."""
        check_refit_args(0, refit_timeout_s)
        if self._group is None:
            raise ValueError("nccl_reshard_refit: init_reshard() first")
        w = self.weights
        info, params = w.info(), w.params()
        if self.destination and self._staging is None:
            self._staging = {n: p.detach().clone() for n, p in params.items()}
        start = time.perf_counter()
        w.version = self._group.refit(
            params,
            w.shape,
            info,
            version=w.version + 1,
            use_checksum=w.cfg.checksum,
            staging=self._staging,
            timeout_s=refit_timeout_s,
        )
        if self.destination:
            return w.version
        if dist.get_rank() != 0:
            return None
        return report(info, w.version, time.perf_counter() - start, w.cfg.checksum)


class SparseSource:
    """Refits remote receivers with the elements changed since this producer's baseline."""

    def __init__(self, weights: RefitWeights) -> None:
        self.weights = weights
        self._baseline: Baseline | None = None

    def baseline(self, shard_rank: int, shard_count: int, transport: str) -> RefitInfo:
        """Keep this producer's share of the weights as the baseline; the refit info."""
        shard = check_shard(shard_rank, shard_count, transport)
        if self.weights.mxfp8:
            raise ValueError("init_remote_sparse_delta_baseline: refit prequantization is on")
        self._baseline = take_baseline(self.weights.tensors(), shard)
        return self.weights.info()

    def send(self, transport: str, targets: list[str], **arguments: Any) -> dict[str, int]:
        """Send the changes to every receiver (`refit/sparse.py`); `arguments`: the rest of
        `stream_remote_sparse_weights`' (`SparseCall`)."""
        call = SparseCall(transport=transport, **arguments)
        baseline = self._require("stream_remote_sparse_weights")
        call.check(baseline.shard, self.weights.info(), targets)
        return stream(
            baseline,
            self.weights.tensors(),
            targets,
            transfer_id=call.transfer_id,
            timeout_s=call.timeout_s,
            api_key=call.api_key(),
            full=call.full_resync,
        )

    def finish(self, succeeded: bool) -> None:
        """Advance the baseline to the streamed version (every receiver applied it), or not."""
        finish(self._require("finish_remote_sparse_delta_sync"), succeeded=bool(succeeded))

    def _require(self, call: str) -> Baseline:
        if self._baseline is None:
            raise ValueError(f"{call}: init_remote_sparse_delta_baseline() first")
        return self._baseline


class Refit:
    """One rank's refit: the weights and a source per transport."""

    def __init__(self, weights: RefitWeights, *, destination: bool) -> None:
        self.weights = weights
        self.ipc = IpcSource(weights)
        self.collective = CollectiveSource(weights)
        self.reshard = ReshardSource(weights, destination=destination)
        self.sparse = SparseSource(weights)

    def prequantize(self, param_names: object) -> RefitInfo:
        """Send `param_names` as MXFP8 (an empty list: none); refused in a reshard group, whose
        members exchange megatron weights in the training dtype."""
        if self.reshard.joined:
            raise ValueError(
                "enable_refit_prequantize: this worker is in a reshard group, whose members "
                "exchange megatron weights in the training dtype"
            )
        return self.weights.prequantize(param_names)

    def close(self) -> None:
        self.ipc.close()
