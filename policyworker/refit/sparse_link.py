"""The sparse refit's wire: every message and every acknowledgement signed with HMAC-SHA256
under the run's shared key (the key itself never travels), and a DEALER link to one receiver
that sends a message and waits, in bounded time, for the acknowledgement of that message.

A message is its frames followed by one more, the signature: the HMAC of each frame's length
(8 bytes, little-endian) and bytes, in order. An acknowledgement is `[b"ACK", JSON {"ok",
"error", "for"}, signature]`, `for` being the first 16 bytes (hex) of the signature of the
message it answers, so that no answer — a late one, or one replayed — is taken for another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence

import zmq

from policyworker.refit.layout import RefitError

SIGNATURE_BYTES = 32


class Refused(RefitError):
    """A message refused on its own (unsigned, malformed, of another transfer): it is answered
    and dropped, and changes nothing — the transfer in progress goes on."""


def key_bytes(key: object, *, name: str = "api_key") -> bytes:
    """The run's shared key as bytes; `ValueError` naming `name` unless a non-empty str."""
    if not (isinstance(key, str) and key):
        raise ValueError(
            f"{name}: the sparse refit signs every message (HMAC-SHA256) with a key shared by "
            f"its trainers and engines: expected a non-empty str, got {type(key).__name__}"
        )
    return key.encode()


def sign(key: bytes, frames: Sequence[bytes]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.digest()


def signed(key: bytes, frames: Sequence[bytes]) -> list[bytes]:
    return [*frames, sign(key, frames)]


def verified(key: bytes, frames: Sequence[bytes]) -> list[bytes]:
    """The frames of a message without its signature; `Refused` unless signed with `key`."""
    if len(frames) < 2 or not hmac.compare_digest(frames[-1], sign(key, frames[:-1])):
        raise Refused("a message not signed with this run's key: refused")
    return list(frames[:-1])


def ack(key: bytes, request: Sequence[bytes], error: str | None) -> list[bytes]:
    """The signed acknowledgement of the message `request` (its frames, signature last)."""
    answers = request[-1][:16].hex() if request else ""
    body = json.dumps({"ok": error is None, "error": error, "for": answers}).encode()
    return signed(key, [b"ACK", body])


class Link:
    """A DEALER to one receiver; each message is acknowledged before the next is sent."""

    def __init__(self, address: str, key: bytes) -> None:
        self.address, self.key = address, key
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def call(self, frames: list[bytes], timeout_s: float) -> None:
        """Send `frames` (signed already: a relay passes them on as they came); `RefitError`
        unless the receiver acknowledges that message within `timeout_s`."""
        self.sock.send_multipart(frames)
        if not self.sock.poll(max(1, int(timeout_s * 1000))):
            raise RefitError(
                f"sparse refit: no answer from the receiver at {self.address} in {timeout_s:.3g} s"
            )
        try:
            kind, body = verified(self.key, self.sock.recv_multipart())
            reply = json.loads(body)
            if kind != b"ACK" or reply["for"] != frames[-1][:16].hex():
                raise ValueError("not the acknowledgement of this message")
            ok, error = reply["ok"] is True, reply["error"]
        except (RefitError, ValueError, KeyError, TypeError) as e:
            raise RefitError(
                f"sparse refit: a bad answer from the receiver at {self.address} ({e})"
            ) from None
        if not ok:
            raise RefitError(f"sparse refit: the receiver at {self.address} refused: {error}")

    def close(self) -> None:
        self.sock.close(linger=0)
