"""Remote sparse-delta refit, the engine's side: a ROUTER socket on TCP that verifies, stages and
then applies all of a transfer's payloads, or none of them (the protocol is in `refit.sparse`).

Every message is signed with the run's key (`sparse_link`). A message that is not — or is
malformed, or belongs to another transfer (a late trainer's, a stray one, a replay) — is
refused on its own: answered, dropped, and nothing else changes (not the weights, not the
transfer in progress, not the readiness for the next). A signed message of this transfer comes
from one of its trainers, so a fault in it (a delta against another version, a bad CRC, a
payload that does not decode or does not fit this engine's tensors, a producer or count out of
range) ends the transfer with `RefitError`, the live weights unchanged.

Relay: receiver i of the transfer's tree — given to `receive` by whoever starts it, never read
from a message — passes each message it accepted on to receivers 2i+1 and 2i+2 and acknowledges
once they have, so a payload leaves the trainer once however many engines there are.

A DATA is checked before it is acknowledged: the base version (the receiver's own: a receiver
that restarted from the HF weights while the trainer is at version k refuses a delta against k,
it never applies it to the wrong bits), the CRC-32, the decode against this engine's refit
info (bounded by it: nothing larger is allocated), each tensor at most once. A payload seen
before (a retry) is acknowledged and not staged twice. The transfer completes when every
producer's DONE has come and its payloads 0..n-1 have; only then are the deltas written into
the live weights, and the version advances.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import zmq

from policyworker.refit.layout import RefitError, RefitInfo
from policyworker.refit.sparse_codec import (
    PayloadError,
    TensorDelta,
    apply_delta,
    decode,
    raw_bound,
)
from policyworker.refit.sparse_link import Link, Refused, ack, key_bytes, verified

log = logging.getLogger(__name__)

_MAX_INT = 2**53  # versions, producers, payload ids and counts: JSON ints a double holds


class SparseReceiver:
    """One engine's receiver: `targets` are its live tensors by HF name, `info` their layout,
    `api_key` the run's shared key."""

    def __init__(
        self,
        targets: Mapping[str, torch.Tensor],
        info: RefitInfo,
        *,
        api_key: str,
        host: str = "127.0.0.1",
    ) -> None:
        self.key = key_bytes(api_key)
        self.targets, self.info, self.host = dict(targets), dict(info), host
        self.version = 0
        """The version of the live weights (0: as loaded from the HF folder)."""
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a frame larger than any payload for these tensors could compress to is cut off by
        # ZMQ before it is buffered whole (zstd's worst case: the input and a small margin)
        bound = raw_bound(self.info)
        self.sock.setsockopt(zmq.MAXMSGSIZE, bound + bound // 128 + (1 << 16))
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._children: dict[str, Link] = {}  # address -> DEALER link (relay), kept

    def close(self) -> None:
        for link in self._children.values():
            link.close()
        self.sock.close(linger=0)

    def receive(
        self,
        transfer_id: str,
        producers: int,
        timeout_s: float,
        *,
        tree: Sequence[str] | None = None,
    ) -> int:
        """One transfer from `producers` producers; returns the version applied. `tree`: the
        engines' addresses as the trainers were given them (None: this receiver alone)."""
        children = self._children_in(tree)
        if not (isinstance(producers, int) and 1 <= producers < _MAX_INT):
            raise ValueError(f"producers: expected an int >= 1, got {producers!r}")
        t = _Transfer(transfer_id, producers)
        deadline = time.monotonic() + timeout_s
        while not t.complete():
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise RefitError(
                    f"sparse refit {transfer_id}: incomplete after {timeout_s} s "
                    f"({t.progress()}); the live weights are unchanged (version {self.version})"
                )
            peer, *frames = self.sock.recv_multipart()
            try:
                kind, meta, payload = _message(self.key, frames, transfer_id)
            except Refused as e:
                t.refused += 1
                log.warning("sparse refit %s: %s", transfer_id, e)
                self.sock.send_multipart([peer, *ack(self.key, frames, str(e))])
                continue
            try:
                self._handle(t, kind, meta, payload)
                self._relay(frames, children, deadline)
            except (RefitError, PayloadError) as e:
                self.sock.send_multipart([peer, *ack(self.key, frames, str(e))])
                raise RefitError(
                    f"sparse refit {transfer_id}: {e}; the live weights are unchanged "
                    f"(version {self.version})"
                ) from None
            self.sock.send_multipart([peer, *ack(self.key, frames, None)])
        return self._apply(t)

    def _children_in(self, tree: Sequence[str] | None) -> list[str]:
        """This receiver's children in `tree` (a binary tree in list order)."""
        if tree is None:
            return []
        tree = list(tree)
        if not all(isinstance(a, str) for a in tree) or self.address not in tree:
            raise ValueError(f"tree: expected addresses including this receiver's ({self.address})")
        if len(set(tree)) < len(tree):
            raise ValueError("tree: an address twice")
        i = tree.index(self.address)
        return tree[2 * i + 1 : 2 * i + 3]

    def _handle(self, t: _Transfer, kind: bytes, meta: dict[str, Any], payload: bytes) -> None:
        producer = _int(meta, "producer", t.producers)
        base, full = _int(meta, "base_version", _MAX_INT), meta.get("full", False)
        if not isinstance(full, bool):
            raise RefitError(f"full: expected true or false, got {full!r}")
        if t.base is None:
            t.base = (base, full)
        elif t.base != (base, full):
            raise RefitError(f"producers disagree on the base: {t.base} and {(base, full)}")
        if not full and base != self.version:
            raise RefitError(
                f"a delta against version {base}, but this receiver holds version "
                f"{self.version} (restarted?): it needs a full resync first"
            )
        if kind == b"DONE":
            count = _int(meta, "payloads", _MAX_INT)
            if t.done.setdefault(producer, count) != count:
                raise RefitError(
                    f"producer {producer} sent two DONEs ({t.done[producer]}, {count})"
                )
            return
        key = (producer, _int(meta, "payload", _MAX_INT))
        if key in t.seen:
            return  # a retry: staged already
        deltas = decode(payload, _int(meta, "crc", 2**32), self.info)
        for d in deltas:
            if d.name in t.names:
                raise RefitError(f"{d.name} arrived twice")
            t.names.add(d.name)
        t.seen.add(key)
        t.staged += deltas

    def _relay(self, frames: list[bytes], children: list[str], deadline: float) -> None:
        """Pass an accepted message on to this receiver's children, as it came (signed)."""
        for child in children:
            if child not in self._children:
                self._children[child] = Link(child, self.key)
            try:
                self._children[child].call(frames, max(0.001, deadline - time.monotonic()))
            except RefitError:
                self._children.pop(child).close()  # a late answer must not meet the next call
                raise

    def _apply(self, t: _Transfer) -> int:
        assert t.base is not None
        full = t.base[0] if t.base[1] else None
        if full is not None and t.names != set(self.info):
            missing = sorted(set(self.info) - t.names)
            raise RefitError(f"sparse refit {t.transfer_id}: a full resync without {missing[:3]}")
        with torch.no_grad():
            for d in t.staged:
                apply_delta(self.targets[d.name], d)
        self.version = (self.version if full is None else full) + 1
        return self.version


def _message(
    key: bytes, frames: list[bytes], transfer_id: str
) -> tuple[bytes, dict[str, Any], bytes]:
    """(kind, meta, payload) of a signed message of this transfer; `Refused` otherwise."""
    body = verified(key, frames)
    kind = body[0]
    if not ((kind == b"DATA" and len(body) == 3) or (kind == b"DONE" and len(body) == 2)):
        raise Refused(f"a message {kind[:16]!r} of {len(body)} frames: refused")
    try:
        meta = json.loads(body[1])
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise Refused("a message whose meta is not a JSON object: refused")
    if meta.get("transfer") != transfer_id:
        raise Refused(
            f"a message of transfer {str(meta.get('transfer'))[:80]!r} during {transfer_id!r} "
            "(stale or foreign): refused, the transfer goes on"
        )
    return kind, meta, body[2] if kind == b"DATA" else b""


def _int(meta: dict[str, Any], name: str, end: int) -> int:
    value = meta.get(name)
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < end):
        raise RefitError(f"{name}: expected an int in [0, {end}), got {value!r}")
    return value


class _Transfer:
    """What one transfer has received so far."""

    def __init__(self, transfer_id: str, producers: int) -> None:
        self.transfer_id, self.producers = transfer_id, producers
        self.seen: set[tuple[int, int]] = set()
        self.done: dict[int, int] = {}
        self.staged: list[TensorDelta] = []
        self.names: set[str] = set()
        self.base: tuple[int, bool] | None = None
        """(base version, full resync): every producer's must agree."""
        self.refused = 0

    def complete(self) -> bool:
        if len(self.done) < self.producers:
            return False
        return all(
            {i for p, i in self.seen if p == producer} == set(range(count))
            for producer, count in self.done.items()
        )

    def progress(self) -> dict[str, Any]:
        return {"payloads": len(self.seen), "producers_done": len(self.done),
                "producers": self.producers, "refused_messages": self.refused}  # fmt: skip
