"""Remote sparse-delta refit, the engine's side: a ROUTER socket on TCP that verifies, stages and
then applies all of a transfer's payloads, or none of them (the protocol is in `refit.sparse`).

Relay: the trainer sends each message to the first receiver of the transfer's `tree` (the
receivers' addresses) only; receiver i passes what it accepted on to receivers 2i+1 and 2i+2
and acknowledges once they have, so a payload leaves the trainer once however many engines
there are, and an acknowledgement means the whole subtree staged it.

Each DATA is checked before it is acknowledged: the transfer id, the API key, the base version
(the receiver's own: a receiver that restarted from the HF weights while the trainer is at
version k refuses a delta against k, it never applies it to the wrong bits), the CRC-32, the
decode, and every tensor's name, shape, dtype and positions against the refit info. A payload
seen before (a retry) is acknowledged and not staged twice. The transfer completes when every
expected producer's DONE has come and its payload count matches; only then are the deltas
written into the live weights, and the version advances. Any refusal or the deadline ends the
transfer with `RefitError`, the live weights unchanged.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
import zmq

from policyworker.refit.layout import RefitError, RefitInfo
from policyworker.refit.sparse_codec import PayloadError, TensorDelta, apply_delta, decode
from policyworker.refit.sparse_link import Link


class SparseReceiver:
    """One engine's receiver: `targets` are its live tensors by HF name, `info` their layout."""

    def __init__(
        self,
        targets: Mapping[str, torch.Tensor],
        info: RefitInfo,
        *,
        api_key: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.targets, self.info, self.api_key = dict(targets), dict(info), api_key
        self.version = 0
        """The version of the live weights (0: as loaded from the HF folder)."""
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._children: dict[str, Any] = {}  # address -> DEALER link (relay), kept

    def close(self) -> None:
        for link in self._children.values():
            link.close()
        self.sock.close(linger=0)

    def receive(self, transfer_id: str, producers: int, timeout_s: float) -> int:
        """One transfer from `producers` producers; returns the version applied."""
        t = _Transfer(transfer_id, producers)
        deadline = time.monotonic() + timeout_s
        while not t.complete():
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise RefitError(
                    f"sparse refit {transfer_id}: incomplete after {timeout_s} s "
                    f"({t.progress()}); the live weights are unchanged (version {self.version})"
                )
            peer, kind, *rest = self.sock.recv_multipart()
            try:
                self._handle(t, kind, rest)
                self._relay(t, [kind, *rest], deadline)
            except (RefitError, PayloadError) as e:
                self._reply(peer, str(e))
                raise RefitError(
                    f"sparse refit {transfer_id}: {e}; the live weights are unchanged "
                    f"(version {self.version})"
                ) from None
            self._reply(peer, None)
        if t.full_base is not None and {d.name for d in t.staged} != set(self.info):
            missing = sorted(set(self.info) - {d.name for d in t.staged})
            raise RefitError(f"sparse refit {transfer_id}: a full resync without {missing[:3]}")
        with torch.no_grad():
            for d in t.staged:
                apply_delta(self.targets[d.name], d)
        self.version = (self.version if t.full_base is None else t.full_base) + 1
        return self.version

    def _handle(self, t: _Transfer, kind: bytes, rest: list[bytes]) -> None:
        meta = json.loads(rest[0])
        if meta.get("transfer") != t.transfer_id:
            raise RefitError(f"a message of transfer {meta.get('transfer')!r} (stale or foreign)")
        if self.api_key is not None and not hmac.compare_digest(
            str(meta.get("key", "")), self.api_key
        ):
            raise RefitError("a message without the right API key")
        if meta.get("full"):  # a full resync: whole tensors, whatever this receiver holds
            t.full_base = int(meta["base_version"])
        elif meta.get("base_version") != self.version:
            raise RefitError(
                f"a delta against version {meta.get('base_version')}, but this receiver holds "
                f"version {self.version} (restarted?): it needs a full resync first"
            )
        producer = int(meta["producer"])
        if kind == b"DONE":
            t.done[producer] = int(meta["payloads"])
            return
        if kind != b"DATA":
            raise RefitError(f"an unknown message {kind[:16]!r}")
        key = (producer, int(meta["payload"]))
        if key in t.seen:
            return  # a retry: staged already
        deltas = decode(rest[1], int(meta["crc"]))
        for d in deltas:
            self._check(d)
        t.seen.add(key)
        t.staged += deltas

    def _relay(self, t: _Transfer, frames: list[bytes], deadline: float) -> None:
        """Pass an accepted message on to this receiver's children in the transfer's tree."""
        tree = json.loads(frames[1]).get("tree") or [self.address]
        if self.address not in tree:
            raise RefitError(f"this receiver ({self.address}) is not in the relay tree")
        i = tree.index(self.address)
        for child in tree[2 * i + 1 : 2 * i + 3]:
            if child not in self._children:
                self._children[child] = Link(child)
            try:
                self._children[child].call(frames, max(0.001, deadline - time.monotonic()))
            except RefitError:
                self._children.pop(child).close()  # a late answer must not meet the next call
                raise

    def _check(self, d: TensorDelta) -> None:
        if d.name not in self.info:
            raise RefitError(f"{d.name} is not in this engine's refit info")
        shape, dtype = self.info[d.name]
        if d.shape != tuple(shape) or d.dtype != dtype:
            raise RefitError(
                f"{d.name} sent as {d.shape} {d.dtype}, expected {tuple(shape)} {dtype}"
            )
        n = torch.Size(shape).numel()
        if (
            d.index is not None
            and d.index.numel()
            and (int(d.index.min()) < 0 or int(d.index.max()) >= n)
        ):
            raise RefitError(f"{d.name}: a position outside its {n} elements")

    def _reply(self, peer: bytes, error: str | None) -> None:
        body = json.dumps({"ok": error is None, "error": error}).encode()
        self.sock.send_multipart([peer, b"ACK", body])


class _Transfer:
    """What one transfer has received so far."""

    def __init__(self, transfer_id: str, producers: int) -> None:
        self.transfer_id, self.producers = transfer_id, producers
        self.seen: set[tuple[int, int]] = set()
        self.done: dict[int, int] = {}
        self.staged: list[TensorDelta] = []
        self.full_base: int | None = None
        """A full resync: the trainer's baseline version it brings this receiver past."""

    def complete(self) -> bool:
        if len(self.done) < self.producers:
            return False
        return all(
            sum(1 for p, _ in self.seen if p == producer) == count
            for producer, count in self.done.items()
        )

    def progress(self) -> dict[str, Any]:
        return {"payloads": len(self.seen), "producers_done": len(self.done),
                "producers": self.producers}  # fmt: skip
