"""Reshard refit: trainer ranks straight into destination workers of another TP layout.

    trainer (TP=S, sources)  ──pieces of each TP-sharded weight──▶  destinations (TP=D)
                             ──one broadcast of every replicated weight (norms)──▶

Members: the trainer's ranks (refit ranks 0..S-1, their own global ranks) and the destination
workers' (S..S+D-1), one process group set up over a TCP store, where each member also posts
its place (role, TP and expert TP/EP ranks and sizes, whether it sends). Both sides cut every
TP-sharded megatron weight into the same pieces: the overlap of a source shard with a destination
shard, along the split dim (each of a mapping's blocks separately; vocabulary rows up to the true
vocabulary). The owner of a piece in data-parallel replica 0 sends exactly that slice to every
destination rank of the matching TP rank: no rank ever holds a whole large weight it does not
own. A routed expert's pieces go from the EP rank that holds it (expert-data-parallel replica 0),
cut along expert TP, to the destinations' EP rank that holds it, expert by expert in order.

One refit: header [version, checksum on, info fingerprint] from refit rank 0; a MIN vote that
the refit info matches; the replicated weights as one broadcast; the pieces, point to point,
each followed by its checksum when on; a final MIN vote. Destinations stage into a copy of their
weights and apply it only when every member voted yes. Every wait has the group's timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from policyworker.model.experts import ExpertSplit
from policyworker.model.hf_config import ModelShape
from policyworker.model.layouts import Mapping, VocabRows
from policyworker.model.weights import mappings
from policyworker.parallel.dims import tcp_store
from policyworker.refit.group import agree, fingerprint, start_broadcast, wait_for
from policyworker.refit.layout import RefitError, RefitInfo, RefitReport, checksum


@dataclass(frozen=True, slots=True)
class Member:
    rank: int
    destination: bool
    tp_rank: int
    tp_size: int
    sends: bool
    """A source of data-parallel replica 0 (context-parallel rank 0): it sends its pieces."""
    etp_rank: int = 0
    etp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    sends_experts: bool = False
    """A source of expert-data-parallel replica 0: it sends its experts' pieces."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One slice along a weight's TP dim: source TP rank's local [src, src+n) goes to the
    destination TP rank's local [dst, dst+n)."""

    src_tp: int
    dst_tp: int
    src: int
    dst: int
    n: int


def pieces(
    m: Mapping, shape: ModelShape, src_tp: int, dst_tp: int, local: int, tp: int
) -> list[Piece]:
    """The pieces of mapping `m` between TP sizes `src_tp` and `dst_tp`. `local` is this side's
    shard length along the TP dim and `tp` this side's TP size (to recover the full length);
    each of `m.blocks` is cut on its own (gate and up; a DeltaNet's q, k, v, z, b, a)."""
    sides = (src_tp, dst_tp)
    if isinstance(m, VocabRows):  # (true length, shard length per TP size) of each block
        blocks = [(shape.vocab_size, {s: shape.padded_vocab_size(s) // s for s in sides})]
    else:
        blocks = [(b, {s: b // s for s in sides}) for b in m.blocks(local * tp)]
    out, src_at, dst_at = [], 0, 0  # each block's start in a source / destination shard
    for true, per in blocks:
        for i in range(src_tp):
            for j in range(dst_tp):
                start = max(i * per[src_tp], j * per[dst_tp])
                end = min((i + 1) * per[src_tp], (j + 1) * per[dst_tp], true)
                if start < end:
                    src = src_at + start - i * per[src_tp]
                    dst = dst_at + start - j * per[dst_tp]
                    out.append(Piece(i, j, src, dst, end - start))
        src_at, dst_at = src_at + per[src_tp], dst_at + per[dst_tp]
    return out


class ReshardGroup:
    """This process's membership of the reshard group, and one refit in either role."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        sources: int,
        destinations: int,
        me: Member,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        world = sources + destinations
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        store = tcp_store(host, port, world, me.rank == 0, self.timeout)  # on `host` alone
        store.set(f"member/{me.rank}", json.dumps(dataclasses.astuple(me)))
        self.members = [Member(*json.loads(store.get(f"member/{r}"))) for r in range(world)]
        self.me = me
        sides = [[m for m in self.members if m.destination == d] for d in (False, True)]
        self.src_tp, self.dst_tp = ({m.tp_size for m in side}.pop() for side in sides)
        self.src_etp, self.dst_etp = ({m.etp_size for m in side}.pop() for side in sides)
        self.src_ep, self.dst_ep = ({m.ep_size for m in side}.pop() for side in sides)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg: dist.ProcessGroup = dist.ProcessGroupNCCL(store, me.rank, world, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, me.rank, world, self.timeout)
        self._store = store  # the group keeps using it

    def _peers(self, piece: Piece, owners: tuple[int, int] | None) -> tuple[int, list[int]]:
        """The sending rank of `piece` and the destination ranks that receive it; a routed
        expert's piece goes between the EP ranks `owners` (source's, destinations')."""
        if owners is None:
            src = next(
                m.rank
                for m in self.members
                if m.sends and m.tp_rank == piece.src_tp and not m.destination
            )
            dsts = [m.rank for m in self.members if m.destination and m.tp_rank == piece.dst_tp]
            return src, dsts
        src_ep, dst_ep = owners
        src = next(
            m.rank
            for m in self.members
            if m.sends_experts and m.etp_rank == piece.src_tp and m.ep_rank == src_ep
        )
        dsts = [
            m.rank
            for m in self.members
            if m.destination and m.etp_rank == piece.dst_tp and m.ep_rank == dst_ep
        ]
        return src, dsts

    def _plan(
        self, params: dict[str, torch.Tensor], shape: ModelShape
    ) -> Iterator[tuple[str, Mapping, list[Piece], tuple[int, int] | None]]:
        """(name, mapping, pieces, owners) of every TP-sharded weight and routed expert's tensor
        (one whole from expert-TP rank 0 where it is not split), the same on every member
        (another EP rank's expert is sized by this rank's of the same slot); `owners`: a routed
        expert's EP rank on the source side and on the destination side, else None."""
        me, experts = self.me, shape.moe.num_experts if shape.moe else 0
        split = ExpertSplit(me.ep_rank, me.ep_size, experts // me.ep_size)
        for m in mappings(shape, me.tp_size):
            e = split.expert(m.mcore)
            if m.tp_dim is None and e is None:
                continue  # in `_replicated`
            if e is None:
                local = params[m.mcore].shape[m.tp_dim]
                yield (
                    m.mcore,
                    m,
                    pieces(m, shape, self.src_tp, self.dst_tp, local, me.tp_size),
                    None,
                )
                continue
            owners = (e // (experts // self.src_ep), e // (experts // self.dst_ep))
            if m.tp_dim is None:  # whole on every expert-TP rank (gpt-oss's fc2 bias)
                whole = params[split.stand_in(m.mcore)].shape[0]
                yield m.mcore, m, [Piece(0, j, 0, 0, whole) for j in range(self.dst_etp)], owners
                continue
            local = params[split.stand_in(m.mcore)].shape[m.tp_dim]
            plan = pieces(m, shape, self.src_etp, self.dst_etp, local, me.etp_size)
            yield m.mcore, m, plan, owners

    def refit(
        self,
        params: dict[str, torch.Tensor],
        shape: ModelShape,
        info: RefitInfo,
        *,
        version: int,
        use_checksum: bool,
        staging: dict[str, torch.Tensor] | None,
        timeout_s: float | None = None,
    ) -> int:
        """One refit; returns the version. Sources pass `staging=None`; destinations a staging
        copy of their weights, applied to `params` only when every member agreed."""
        if timeout_s is not None:
            self.timeout = datetime.timedelta(seconds=timeout_s)
        head = torch.tensor([version, int(use_checksum), fingerprint(info)], device=self.device)
        wait_for(start_broadcast(self.pg, head, "the header"), "the header", self.timeout)
        version, use_checksum, theirs = (int(x) for x in head.tolist())
        if not agree(
            self.pg, theirs == fingerprint(info), self.device, "the refit info check", self.timeout
        ):
            raise RefitError("reshard: the trainer's refit info differs from a destination's")
        ok, error = True, ""
        target = params if staging is None else staging
        try:
            self._replicated(params, target, shape)
            tag = 0
            for name, m, plan, owners in self._plan(params, shape):
                move = Move(params.get(name), target.get(name), m.tp_dim or 0, owners)
                tag = self._move(move, plan, tag, bool(use_checksum))
        except RefitError as e:
            if staging is None:
                raise
            ok, error = False, str(e)
        if not agree(self.pg, ok, self.device, "the end of the refit", self.timeout):
            raise RefitError(error or "reshard: a destination rejected the refit (unchanged)")
        if staging is not None:
            with torch.no_grad():
                for name, t in staging.items():
                    params[name].copy_(t)
        return version

    def _replicated(
        self, params: dict[str, torch.Tensor], target: dict[str, torch.Tensor], shape: ModelShape
    ) -> None:
        """Every replicated weight in one flat broadcast from refit rank 0."""
        experts = ExpertSplit(0, 1, 1)  # which names are routed experts' (any split says)
        names = [
            m.mcore
            for m in mappings(shape, self.me.tp_size)
            if m.tp_dim is None and m.mcore in params and experts.expert(m.mcore) is None
        ]
        if not names:
            return
        flat = torch.cat([params[n].detach().reshape(-1) for n in names])
        if self.me.destination or self.me.rank != 0:
            flat = torch.empty_like(flat)
        wait_for(
            start_broadcast(self.pg, flat, "the replicated weights"),
            "the replicated weights",
            self.timeout,
        )
        if self.me.destination:
            offset = 0
            with torch.no_grad():
                for n in names:
                    t = target[n]
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _move(self, move: Move, plan: list[Piece], tag: int, use_checksum: bool) -> int:
        """Send or receive one weight's pieces; returns the next tag."""
        works: list[tuple[dist.Work, str]] = []
        received: list[tuple[Piece, torch.Tensor, torch.Tensor | None]] = []
        keep = []
        dim = move.dim
        for piece in plan:
            src, dsts = self._peers(piece, move.owners)
            tag += 1
            if self.me.rank == src:
                assert move.param is not None
                data = move.param.detach().narrow(dim, piece.src, piece.n).contiguous()
                total = torch.tensor([_sum(data)], device=self.device)
                keep += [data, total]
                for d in dsts:
                    works.append((self.pg.send([data], d, tag), f"piece {tag} to rank {d}"))
                    if use_checksum:
                        works.append((self.pg.send([total], d, tag + 1_000_000), f"checksum {tag}"))
            elif self.me.rank in dsts:
                assert move.target is not None
                shape = list(move.target.shape)
                shape[dim] = piece.n
                data = torch.empty(shape, dtype=move.target.dtype, device=self.device)
                works.append((self.pg.recv([data], src, tag), f"piece {tag} from rank {src}"))
                total = None
                if use_checksum:
                    total = torch.zeros(1, dtype=torch.int64, device=self.device)
                    works.append((self.pg.recv([total], src, tag + 1_000_000), f"checksum {tag}"))
                received.append((piece, data, total))
        for work, what in works:
            wait_for(work, what, self.timeout)
        with torch.no_grad():
            for piece, data, total in received:
                if total is not None and _sum(data) != int(total.item()):
                    raise RefitError(
                        f"reshard: a piece ({piece.n} along dim {dim}) failed its checksum"
                    )
                move.target.narrow(dim, piece.dst, piece.n).copy_(data)  # type: ignore[union-attr]
        return tag


@dataclass(frozen=True, slots=True)
class Move:
    """One TP-sharded weight of a refit: this member's tensor to send from and to write into
    (None where another EP rank holds the expert), its split dim, and for a routed expert the
    EP ranks that hold it (source side, destination side)."""

    param: torch.Tensor | None
    target: torch.Tensor | None
    dim: int
    owners: tuple[int, int] | None


def report(info: RefitInfo, version: int, seconds: float, use_checksum: bool) -> RefitReport:
    """A reshard refit's report, counting the whole model's bytes as the other transports do."""
    nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
    return RefitReport(version, nbytes, seconds, len(info), 0, use_checksum)


def _sum(data: torch.Tensor) -> int:
    """`checksum` of a piece of any byte length: its 8-byte words, then the bytes left over."""
    raw = data.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    return checksum(raw[:whole]) + int(raw[whole:].sum())
