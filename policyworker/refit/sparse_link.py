"""A DEALER to one sparse-refit receiver: each message answered before the next, in bounded time
(the trainer's link to the relay tree's root, and each receiver's to its children)."""

from __future__ import annotations

import json

import zmq

from policyworker.refit.layout import RefitError


class Link:
    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def call(self, frames: list[bytes], timeout_s: float) -> None:
        """Send `frames`; `RefitError` unless the receiver acknowledges them within `timeout_s`."""
        self.sock.send_multipart(frames)
        if not self.sock.poll(max(1, int(timeout_s * 1000))):
            raise RefitError(
                f"sparse refit: no answer from the receiver at {self.address} in {timeout_s:.3g} s"
            )
        kind, body = self.sock.recv_multipart()
        reply = json.loads(body)
        if kind != b"ACK" or not reply.get("ok"):
            raise RefitError(
                f"sparse refit: the receiver at {self.address} refused: {reply.get('error')}"
            )

    def close(self) -> None:
        self.sock.close(linger=0)
