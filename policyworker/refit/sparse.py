"""Remote sparse-delta refit, the trainer's side: a sharded baseline, and per refit only the
elements whose bits changed, over ZeroMQ/TCP to engines on other machines (docs/refit.md).

Ownership: the refit info's tensors are dealt to the producers in order — tensor i belongs to
producer `i % shard_count` — so each tensor has exactly one owner, which alone keeps its
baseline (the HF export's bits when the baseline was taken, CPU) and compares, encodes and
sends it. Every rank still takes part in the export's TP gathers and PP broadcasts.

One refit (`stream`): the export, tensor by tensor; each owned tensor's delta against its
baseline, coalesced into payloads of up to `bucket_bytes` (raw), each compressed and sent once —
by a sender thread while the next tensors are compared (a bounded pipeline) — to the first
receiver, which acknowledges it once it — and, down the relay tree, every other receiver — has
verified and staged it; then a DONE with the
payload count. The deltas are kept as pending: `finish(succeeded=True)` — called once every
receiver has applied the version — writes them into the baseline; `finish(False)` drops them,
so the next refit sends again what this one carried (the baseline is never ahead of a receiver).

Messages (multipart; a DEALER to the first receiver, whose ROUTER answers each; the receivers
relay them down the binary tree of `targets` they were started with, `refit.sparse_receiver`),
each signed — HMAC-SHA256 under the run's key, which never travels (`refit.sparse_link`):

    DATA  [b"DATA", meta JSON, payload, signature]  meta: transfer, producer, payload,
                                                    base_version, full, crc
    DONE  [b"DONE", meta JSON, signature]           meta: transfer, producer, payloads,
                                                    base_version, full
    reply [b"ACK", JSON {"ok", "error", "for"}, signature]
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.refit.sparse_codec import TensorDelta, apply_delta, delta, encode, whole
from policyworker.refit.sparse_link import Link, key_bytes, signed

TRANSPORTS = ("zmq", "vllm_zmq_sparse")
KEY_ENV = "POLICYWORKER_SPARSE_REFIT_KEY"
"""Where a run that makes its own key (the demo, refit-check) keeps it for the trainers."""


def fresh_key_env() -> dict[str, str]:
    """`{KEY_ENV: a random 256-bit key}`: for the workers' environment (`Policy(env=...)`)
    and the engines' `bind_sparse(api_key=...)`."""
    return {KEY_ENV: secrets.token_hex(32)}


BUCKET_BYTES = 64 << 20
PIPELINE = 2  # full payloads waiting for the sender thread, at most


@dataclass(frozen=True, slots=True)
class Shard:
    """This producer's place among `count` producers."""

    rank: int
    count: int

    def owns(self, index: int) -> bool:
        return index % self.count == self.rank


@dataclass(slots=True)
class SparseSource:
    """One producer's baseline, its version, and the deltas of a refit not yet committed."""

    shard: Shard
    baseline: dict[str, torch.Tensor]
    version: int = 0
    """The version the baseline holds (0: the HF weights the engines loaded)."""
    pending: list[TensorDelta] | None = None


def check_shard(shard_rank: object, shard_count: object, transport: object) -> Shard:
    ok = isinstance(shard_count, int) and shard_count >= 1
    if not ok:
        raise ValueError(f"shard_count: expected an int >= 1, got {shard_count!r}")
    if not (isinstance(shard_rank, int) and 0 <= shard_rank < shard_count):  # type: ignore[operator]
        raise ValueError(f"shard_rank: expected an int in [0, {shard_count}), got {shard_rank!r}")
    if transport not in TRANSPORTS:
        raise ValueError(
            f"transport: expected one of {TRANSPORTS} (S3 is not built), got {transport!r}"
        )
    return Shard(shard_rank, shard_count)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class SparseCall:
    """The seed's arguments of one `stream_remote_sparse_weights` call."""

    transport: str
    transfer_id: str
    api_key_env_var: str | None
    timeout_s: float
    shard_rank: int
    shard_count: int
    overwrite_names: list[str]
    """Names the reference sends as absolute values rather than XOR; every delta here is absolute,
    so any list is accepted (checked against the refit info)."""
    full_resync: bool = False
    """Send every tensor whole, to receivers at any version (one restarted from the HF weights)."""

    def check(self, shard: Shard, info: Mapping[str, Any], targets: list[str]) -> None:
        """`ValueError` naming the argument; nothing has moved yet."""
        if check_shard(self.shard_rank, self.shard_count, self.transport) != shard:
            raise ValueError(
                f"shard_rank/shard_count: the baseline was taken as {shard.rank}/{shard.count}, "
                f"got {self.shard_rank}/{self.shard_count}"
            )
        if not targets or not all(isinstance(t, str) and t.startswith("tcp://") for t in targets):
            raise ValueError(
                f"targets: expected receiver addresses tcp://host:port, got {targets!r}"
            )
        if not (isinstance(self.transfer_id, str) and self.transfer_id):
            raise ValueError(f"transfer_id: expected a non-empty str, got {self.transfer_id!r}")
        if not (isinstance(self.timeout_s, int | float) and 0 < self.timeout_s < float("inf")):
            raise ValueError(f"timeout_s: expected a finite number > 0, got {self.timeout_s!r}")
        unknown = [n for n in self.overwrite_names if n not in info]
        if unknown:
            raise ValueError(f"overwrite_names: not in the refit info: {unknown[:3]}")
        self.api_key()

    def api_key(self) -> str:
        """The run's key, from the environment variable `api_key_env_var` names: every
        message is signed with it (the engines were bound with the same key)."""
        var = self.api_key_env_var
        if not (isinstance(var, str) and var):
            raise ValueError(
                "api_key_env_var: the sparse refit signs every message (HMAC-SHA256) with a key "
                "shared by its trainers and engines; name the environment variable holding it, "
                f"got {var!r}"
            )
        if not os.environ.get(var):
            raise ValueError(f"api_key_env_var: the environment has no {var!r}")
        return os.environ[var]


def take_baseline(tensors: Iterator[tuple[str, torch.Tensor]], shard: Shard) -> SparseSource:
    """The owned tensors' bits, on the CPU (every rank iterates the whole export)."""
    owned = {
        name: t.detach().to("cpu", copy=True)
        for i, (name, t) in enumerate(tensors)
        if shard.owns(i)
    }
    return SparseSource(shard, owned)


def stream(
    source: SparseSource,
    tensors: Iterator[tuple[str, torch.Tensor]],
    targets: list[str],
    *,
    transfer_id: str,
    timeout_s: float,
    api_key: str,
    full: bool = False,
    bucket_bytes: int = BUCKET_BYTES,
) -> dict[str, int]:
    """Send this producer's deltas to the receivers in `targets` (through the first, which
    relays); they become `pending`. `full`: every owned tensor whole, to receivers at any
    version (a full resync: they end at the version this refit makes). Raises `RefitError` if
    a receiver refuses or does not answer in time (then nothing is pending)."""
    source.pending = None
    meta = {"transfer": transfer_id, "producer": source.shard.rank,
            "base_version": source.version, "full": full}  # fmt: skip
    key = key_bytes(api_key)
    out = _Payloads(Link(targets[0], key), meta, timeout_s, bucket_bytes)
    pending: list[TensorDelta] = []
    try:
        for i, (name, t) in enumerate(tensors):
            if source.shard.owns(i):
                d = delta(name, t.detach(), source.baseline[name])
                pending.append(d)
                out.add(whole(d, t) if full else d, t.numel())
        out.finish()
    finally:
        out.close()
        out.link.close()
    source.pending = pending
    return out.stats


class _Payloads:
    """Deltas coalesced into payloads of up to `bucket_bytes` (raw). A sender thread compresses
    and sends each full payload while the caller goes on comparing the next tensors (zstd and
    torch release the GIL); at most `PIPELINE` payloads wait for it, so memory stays bounded.
    The link is used by the sender thread alone until it has ended (`finish`, `close`)."""

    def __init__(
        self, link: Link, meta: dict[str, Any], timeout_s: float, bucket_bytes: int
    ) -> None:
        self.link, self.meta, self.timeout_s = link, meta, timeout_s
        self.bucket_bytes = bucket_bytes
        self.bucket: list[TensorDelta] = []
        self.bucket_size = 0  # raw bytes of `bucket`
        self.stats = dict.fromkeys(
            ("payloads", "wire_bytes", "changed_elements", "total_elements"), 0
        )
        self.queued = 0  # payload ids handed to the sender
        self.error: BaseException | None = None
        self.waiting: queue.Queue[tuple[int, list[TensorDelta]] | None] = queue.Queue(PIPELINE)
        self.sender = threading.Thread(target=self._send_all, name="sparse-refit-send")
        self.sender.start()

    def add(self, d: TensorDelta, elements: int) -> None:
        self.stats["changed_elements"] += d.changed
        self.stats["total_elements"] += elements
        self.bucket.append(d)
        self.bucket_size += d.nbytes
        if self.bucket_size >= self.bucket_bytes:
            self._queue()

    def finish(self) -> None:
        """The last payload (at least one: a receiver learns the version even if nothing
        changed), then — once every payload was acknowledged — DONE with the count."""
        if self.bucket or not self.queued:
            self._queue()
        self.close()
        if self.error is not None:
            raise self.error
        done = self.meta | {"payloads": self.stats["payloads"]}
        self.link.call(signed(self.link.key, [b"DONE", json.dumps(done).encode()]), self.timeout_s)

    def close(self) -> None:
        """Stop the sender after what it was given (idempotent)."""
        if self.sender.is_alive():
            self.waiting.put(None)
            self.sender.join()

    def _queue(self) -> None:
        if self.error is not None:
            raise self.error
        self.waiting.put((self.queued, self.bucket))  # blocks while PIPELINE payloads wait
        self.queued += 1
        self.bucket, self.bucket_size = [], 0

    def _send_all(self) -> None:
        """The sender thread: each payload compressed and sent in order; after an error it only
        drains the queue (the caller sees the error at its next payload or at `finish`)."""
        while (item := self.waiting.get()) is not None:
            if self.error is not None:
                continue
            index, deltas = item
            try:
                body, crc = encode(deltas)
                meta = self.meta | {"payload": index, "crc": crc}
                frames = signed(self.link.key, [b"DATA", json.dumps(meta).encode(), body])
                self.link.call(frames, self.timeout_s)
                self.stats["payloads"] += 1
                self.stats["wire_bytes"] += len(body)
            except BaseException as e:  # re-raised in the caller's thread
                self.error = e


def finish(source: SparseSource, *, succeeded: bool) -> None:
    """Commit the pending deltas into the baseline (every receiver applied them), or drop them."""
    pending, source.pending = source.pending, None
    if not succeeded or pending is None:
        return
    for d in pending:
        apply_delta(source.baseline[d.name], d)
    source.version += 1
