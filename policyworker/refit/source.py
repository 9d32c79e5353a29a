"""The trainer's side of refit: refit info, the weight version, and the transports' entry points."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from policyworker.config import RefitConfig, finite
from policyworker.model.hf_config import ModelShape
from policyworker.model.weights import export_hf_weights
from policyworker.parallel.dims import Groups
from policyworker.refit.buffers import sweep_dead
from policyworker.refit.collective import broadcast_refit
from policyworker.refit.export import model_tensors, owners, refit_info
from policyworker.refit.group import join_refit_group
from policyworker.refit.ipc import IpcLink, private_endpoint, release_endpoint, send_ipc
from policyworker.refit.layout import Layout, RefitInfo, RefitReport
from policyworker.refit.prequantize import check_prequantize, prequantized, prequantized_info
from policyworker.refit.reshard import Member, ReshardGroup, report
from policyworker.refit.sparse import (
    SparseCall,
    SparseSource,
    check_shard,
    finish,
    stream,
    take_baseline,
)

MiB = 1 << 20


def check_refit_args(buffer_size_bytes: int, timeout_s: float | None, num_buffers: int = 2) -> None:
    """A refit call's arguments, refused before anything moves (`buffer_size_bytes` 0: auto).
    The one place they are checked: every entry point of `RefitSource` calls it first."""
    size = buffer_size_bytes
    if not isinstance(size, int) or not (size == 0 or size >= 512):
        raise ValueError(f"buffer_size_bytes: expected 0 (auto) or an int >= 512, got {size!r}")
    if timeout_s is not None and not (finite(timeout_s) and timeout_s > 0):
        raise ValueError(f"refit_timeout_s: expected a finite number > 0, got {timeout_s!r}")
    if not isinstance(num_buffers, int) or num_buffers < 1:
        raise ValueError(f"num_buffers: expected an int >= 1, got {num_buffers!r}")


class RefitSource:
    """One rank's refit state: what it sends, to where, and the version of the last refit."""

    def __init__(
        self,
        params: Callable[[], dict[str, torch.Tensor]],
        shape: ModelShape,
        groups: Groups,
        device: torch.device,
        cfg: RefitConfig,
    ) -> None:
        self._params, self.shape, self.groups = params, shape, groups
        self.device, self.cfg = device, cfg
        self.version = 0
        """Version of the weights last refitted (0: none yet); each refit sends version + 1."""
        self._base: RefitInfo | None = None  # the bf16 refit info
        self._info: RefitInfo | None = None  # what is sent (MXFP8 slots when prequantizing)
        self._mxfp8: frozenset[str] = frozenset()
        self._sparse: SparseSource | None = None  # remote sparse-delta refit (`refit.sparse`)
        self._group: dist.ProcessGroup | None = None  # the collective refit group (sender only)
        self._owners: list[int] = []
        self._reshard: ReshardGroup | None = None
        self._staging: dict[str, torch.Tensor] | None = None  # a destination's, made once
        self._layout: Layout | None = None  # the last one cut (the size rarely changes)
        self.address = private_endpoint(f"rank{dist.get_rank()}.sock")
        """Where this rank's colocated receiver connects (ZMQ IPC endpoint)."""
        self.link = IpcLink(self.address)  # the receiver's staging areas, kept mapped
        self._released = False
        sweep_dead()

    def close(self) -> None:
        """Drop the receiver's mappings and this rank's endpoint (idempotent)."""
        self.link.reset()
        if not self._released:
            self._released = True
            release_endpoint(self.address)

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) of this pipeline stage, TP shards gathered (collective over TP)."""
        return export_hf_weights(self._params(), self.shape, self.groups)

    def info(self) -> RefitInfo:
        """Refit info of the whole model (collective over the pipeline group the first time)."""
        if self._info is None:
            base = self._base_info()
            self._info = prequantized_info(base, self._mxfp8) if self._mxfp8 else base
        return self._info

    def prequantize(self, names: object) -> RefitInfo:
        """Send `names` as MXFP8 from now on (an empty list: none); the new refit info."""
        if self._reshard is not None:
            raise ValueError(
                "enable_refit_prequantize: this worker is in a reshard group, whose members "
                "exchange megatron weights in the training dtype"
            )
        self._mxfp8 = check_prequantize(names, self._base_info())
        self._info = self._layout = None
        return self.info()

    def sparse_baseline(self, shard_rank: int, shard_count: int, transport: str) -> RefitInfo:
        """Take this producer's share of the baseline (collective: the whole export runs)."""
        shard = check_shard(shard_rank, shard_count, transport)
        if self._mxfp8:
            raise ValueError("init_remote_sparse_delta_baseline: refit prequantization is on")
        self._sparse = take_baseline(self._tensors(), shard)
        return self.info()

    def sparse_stream(self, targets: list[str], opts: SparseCall) -> dict[str, int]:
        """One sparse refit to `targets` (collective over TP/PP: every rank exports)."""
        sparse = self._sparse
        if sparse is None:
            raise ValueError(
                "stream_remote_sparse_weights: init_remote_sparse_delta_baseline() first"
            )
        opts.check(sparse.shard, self.info(), targets)
        return stream(
            sparse, self._tensors(), targets, transfer_id=opts.transfer_id,
            timeout_s=opts.timeout_s, api_key=opts.api_key(), full=opts.full_resync,
        )  # fmt: skip

    def sparse_finish(self, succeeded: bool) -> None:
        """Advance the baseline to the streamed version (every receiver applied it), or not."""
        if self._sparse is None:
            raise ValueError("finish_remote_sparse_delta_sync: no baseline (init first)")
        finish(self._sparse, succeeded=bool(succeeded))

    def _base_info(self) -> RefitInfo:
        if self._base is None:
            params = self._params()
            self._base = refit_info(params, self.shape, self.groups)
            self._owners = owners(params, self.shape, self.groups)
        return self._base

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a refit sends, in `info()` order (collective over TP and PP)."""
        base = self._base_info()
        stream = model_tensors(
            self._params(), self.shape, self.groups, base, self._owners, self.device
        )
        return prequantized(stream, self._mxfp8) if self._mxfp8 else stream

    def stream_ipc(
        self, *, buffer_size_bytes: int, timeout_s: float | None, send: bool
    ) -> RefitReport | None:
        """Stream every weight to the receiver at `self.address` (if `send`; the other ranks
        only take part in the TP/PP gathers). Collective over the model-parallel group."""
        check_refit_args(buffer_size_bytes, timeout_s)
        info = self.info()
        size = self._bucket_bytes(buffer_size_bytes)
        if self._layout is None or self._layout.bucket_bytes != size:  # Python over every tensor
            self._layout = Layout(info, size)
        layout = self._layout
        tensors = self._tensors()
        if not send:
            for _ in tensors:
                pass
            return None
        report = send_ipc(
            tensors,
            layout,
            link=self.link,
            version=self.version + 1,
            timeout_s=timeout_s or self.cfg.timeout_s,
            use_checksum=self.cfg.checksum,
            device=self.device,
        )
        self.version = report.version
        return report

    def join_collective(
        self, host: str, port: int, world_size: int, timeout_s: float | None
    ) -> None:
        """Rank 0 of the trainer joins the refit group as its rank 0 (blocks until every receiver
        has joined); the other trainer ranks only take part in the gathers of a refit."""
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size: expected an int >= 2, got {world_size!r}")
        check_refit_args(0, timeout_s)
        if dist.get_rank() == 0:
            self._group = join_refit_group(
                host,
                port,
                world_size,
                0,
                device=self.device,
                timeout_s=timeout_s or self.cfg.timeout_s,
            )

    def broadcast(
        self, *, buffer_size_bytes: int | None, num_buffers: int, timeout_s: float | None
    ) -> RefitReport | None:
        """One collective refit (collective over the model-parallel group too)."""
        check_refit_args(buffer_size_bytes or 0, timeout_s, num_buffers)
        info = self.info()
        tensors = self._tensors()
        if self._group is None:
            for _ in tensors:  # take part in the TP/PP gathers
                pass
            return None
        report = broadcast_refit(
            self._group,
            tensors,
            info,
            version=self.version + 1,
            bucket_bytes=self._bucket_bytes(buffer_size_bytes),
            num_buffers=num_buffers,
            use_checksum=self.cfg.checksum,
            device=self.device,
            timeout_s=timeout_s or self.cfg.timeout_s,
        )
        self.version = report.version
        return report

    def join_reshard(
        self,
        host: str,
        port: int,
        sources: int,
        destinations: int,
        *,
        destination: bool,
        timeout_s: float | None,
    ) -> None:
        """Join the reshard group as a trainer rank (0..sources-1) or a destination rank."""
        check_refit_args(0, timeout_s)
        if self._mxfp8:
            raise ValueError(
                "init_reshard: refit prequantization is on (enable_refit_prequantize); reshard "
                "members exchange megatron weights in the training dtype"
            )
        g = self.groups
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
        self._reshard = ReshardGroup(
            host,
            port,
            sources=sources,
            destinations=destinations,
            me=me,
            device=self.device,
            timeout_s=timeout_s or self.cfg.timeout_s,
        )

    def reshard(self, *, destination: bool, timeout_s: float | None) -> RefitReport | int | None:
        """One reshard refit, sending (trainer) or receiving (destination, applied only when
        complete); the trainer's rank 0 returns the report, a destination the version."""
        check_refit_args(0, timeout_s)
        if self._reshard is None:
            raise ValueError("nccl_reshard_refit: init_reshard() first")
        info, params = self.info(), self._params()
        if destination and self._staging is None:
            self._staging = {n: p.detach().clone() for n, p in params.items()}
        start = time.perf_counter()
        self.version = self._reshard.refit(
            params,
            self.shape,
            info,
            version=self.version + 1,
            use_checksum=self.cfg.checksum,
            staging=self._staging if destination else None,
            timeout_s=timeout_s,
        )
        if destination:
            return self.version
        if dist.get_rank() != 0:
            return None
        return report(info, self.version, time.perf_counter() - start, self.cfg.checksum)

    def _bucket_bytes(self, requested: int | None) -> int:
        """A call's size, else the config's, else a tenth of free device memory (64 MiB-2 GiB;
        64 MiB on CPU)."""
        if requested or self.cfg.buffer_size_bytes:
            return requested or self.cfg.buffer_size_bytes
        if self.device.type != "cuda":
            return 64 * MiB
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(min(max(free // 10, 64 * MiB), 2048 * MiB)) // 512 * 512
