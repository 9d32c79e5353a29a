"""Colocated refit: the trainer writes the receiver's staging bytes, or goes through two buffers.

Every refit starts with "begin" (the trainer's whole slot list, checked by the receiver before any
byte moves) and ends with "complete". The receiver's answer to "begin" picks the path:

* direct (the receiver shares its staging area): the trainer maps it and packs every bucket
  straight into it — one pass over the bytes, no per-bucket messages, no buffers of its own —
  then sends the buckets' headers (and checksums) with "complete";
* buffers (it does not): for each bucket, pack it into buffer (k % 2) [a bucket larger than a
  buffer: its own buffer], checksum it on the device, wait for the ack of bucket k-1, send its
  header. Bucket k-1's header goes out as soon as it is packed, so the receiver stages bucket
  k-1 while the sender packs bucket k; a buffer is reused only after the ack of the bucket it
  held (k-2).

The receiver (REP, connects) verifies each bucket (`receiver.Staging`) and on "complete" checks
that every name arrived once and applies the refit. Every wait has a deadline; an error on either
side is answered to the other (when it is still there) and raised as `RefitError`. The messages
are in docs/refit.md.

Nothing off the socket is unpickled: messages are JSON (a buffer's handle too). The trainer's
endpoint lives in a folder of its own (`private_endpoint`: made with `mkdtemp`, mode 0700, one
per process), so no other user can reach, bind or replace it; the trainer refuses to bind a path
that exists, makes its socket 0600 and, where the OS offers it, accepts only peers of its own uid
(ZMQ's SO_PEERCRED filter); the receiver connects only to an endpoint in a folder that is its
user's and closed to everyone else.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import zmq

from policyworker.refit.buffers import PREFIX, MappedBuffer, SharedBuffer
from policyworker.refit.layout import (
    Bucket,
    Layout,
    RefitError,
    RefitReport,
    bucket_header,
    checksum,
    checksum_on_device,
    pack,
    slot_headers,
)
from policyworker.refit.receiver import Staging


class _Private:
    """This process's endpoint folder (0700, made with `mkdtemp`, named after the pid so that
    `buffers.sweep_dead` removes a dead process's) and the endpoints handed out in it: removed
    when the last is released (a worker's shutdown), or at exit — never while one is in use,
    so its name is never free for another user to take."""

    folder: ClassVar[str | None] = None
    users: ClassVar[int] = 0  # endpoints handed out and not released


def private_endpoint(name: str) -> str:
    """An `ipc://` endpoint named `name` in this process's private folder (two workers of one
    process and rank get the same one: they refit one at a time)."""
    if _Private.folder is None:
        _Private.folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        atexit.register(shutil.rmtree, _Private.folder, ignore_errors=True)
    _Private.users += 1
    return f"ipc://{os.path.join(_Private.folder, name)}"


def release_endpoint(address: str) -> None:
    """The endpoint's socket file removed; the private folder too once no endpoint is left."""
    remove_socket_file(address)
    path = _socket_path(address)
    if path is None or _Private.folder is None or os.path.dirname(path) != _Private.folder:
        return
    _Private.users -= 1
    if _Private.users <= 0:
        shutil.rmtree(_Private.folder, ignore_errors=True)
        _Private.folder, _Private.users = None, 0


def _socket_path(address: str) -> str | None:
    """The socket file of an `ipc://` endpoint (None for another transport's address)."""
    return address.removeprefix("ipc://") if address.startswith("ipc://") else None


def check_private(address: str) -> None:
    """Refuse (`RefitError`) an `ipc://` endpoint whose folder is not this user's alone: another
    user could have bound it, or could connect to it."""
    path = _socket_path(address)
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(folder)
    except OSError as e:
        raise RefitError(f"refit: the endpoint's folder {folder} is not there ({e})") from None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RefitError(
            f"refit: refusing the endpoint {address}: its folder must be this user's and closed "
            f"to others (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); use "
            "`private_endpoint`"
        )


def _bind(sock: zmq.Socket, address: str) -> None:
    """Bind the trainer's end: never over an existing path, only for this user's processes."""
    check_private(address)
    path = _socket_path(address)
    if path is not None and os.path.lexists(path):
        raise RefitError(f"refit: {path} exists; refusing to bind over it (another refit's?)")
    with contextlib.suppress(AttributeError, zmq.ZMQError):  # SO_PEERCRED, where there is one
        sock.setsockopt(zmq.IPC_FILTER_UID, os.getuid())
    sock.bind(address)
    if path is not None:
        os.chmod(path, 0o600)


def remove_socket_file(address: str) -> None:
    """The file of an `ipc://` endpoint this process bound (ZMQ leaves it when the socket
    closes); the next refit binds it again."""
    path = _socket_path(address)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _socket(kind: int, timeout_s: float) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    return sock


def _request(sock: zmq.Socket, message: dict[str, Any], what: str, peer: str) -> dict[str, Any]:
    """Send and wait for the answer; a silent or refusing receiver is a `RefitError`."""
    try:
        sock.send_json(message)
    except zmq.Again:
        raise _timeout(peer, what) from None
    return _answer(sock, what, peer)


def _answer(sock: zmq.Socket, what: str, peer: str) -> dict[str, Any]:
    """The receiver's answer to `what`, which must be ok."""
    try:
        reply = _json(sock.recv())
    except zmq.Again:
        raise _timeout(peer, what) from None
    if reply.get("ok") is not True:
        raise RefitError(f"refit: the receiver at {peer} refused {what}: {reply.get('error')}")
    return reply


def _json(frame: bytes) -> dict[str, Any]:
    """A message: a JSON object, else `RefitError`."""
    try:
        message = json.loads(frame)
    except (UnicodeDecodeError, ValueError):
        message = None
    if not isinstance(message, dict):
        raise RefitError(f"refit: a message that is not a JSON object ({len(frame)} bytes)")
    return message


def _timeout(peer: str, what: str) -> RefitError:
    return RefitError(f"refit: the receiver at {peer} did not answer {what} in time (timeout)")


class _Pending:
    """A bucket whose header was sent and whose ack is still to come."""

    def __init__(self, header: dict[str, Any], buffer: SharedBuffer, own: bool) -> None:
        self.header, self.buffer, self.own = header, buffer, own


@dataclass(frozen=True, slots=True)
class _Refit:
    """One refit's inputs, as both paths take them."""

    tensors: Iterator[tuple[str, torch.Tensor]]
    layout: Layout
    version: int
    use_checksum: bool
    device: torch.device


class IpcLink:
    """What a trainer keeps between IPC refits to the receiver at `address`: its mappings of
    the receiver's last `keep` staging areas. Opening a CUDA IPC mapping of a whole model costs
    milliseconds, and while one is alive torch reuses it for the same memory (a receiver that
    adopts alternates between two areas). A failed refit drops them (the receiver may be gone).

    The socket is not kept: a REQ socket bound across refits may send the next refit's first
    message down the connection of the previous receiver, closed but not yet reaped — lost.
    """

    def __init__(self, address: str, keep: int = 2) -> None:
        self.address, self.keep = address, keep
        self._recent: list[MappedBuffer] = []

    def open(self, handle: dict[str, Any]) -> MappedBuffer:
        mapped = MappedBuffer(handle)  # before older ones are dropped: their mapping is reused
        self._recent.append(mapped)
        while len(self._recent) > max(self.keep, 1):
            self._recent.pop(0).close()
        return mapped

    def reset(self) -> None:
        for mapped in self._recent:
            mapped.close()
        self._recent = []


def send_ipc(
    tensors: Iterator[tuple[str, torch.Tensor]],
    layout: Layout,
    *,
    link: IpcLink,
    version: int,
    timeout_s: float,
    use_checksum: bool,
    device: torch.device,
) -> RefitReport:
    """Stream `tensors` (in `layout` order) to the receiver connected at `link.address`."""
    start = time.perf_counter()
    address = link.address
    sock = _socket(zmq.REQ, timeout_s)
    try:
        _bind(sock, address)
    except BaseException:
        sock.close()
        raise
    try:
        begin = {
            "type": "begin",
            "version": version,
            "total": layout.total,
            "slots": slot_headers(layout.slots.values()),
        }
        staging = _request(sock, begin, "the start of the refit", address).get("staging")
        refit = _Refit(tensors, layout, version, use_checksum, device)
        if staging is not None:
            headers = _write_direct(link.open(staging).tensor, refit)
        else:
            headers = _send_buffered(sock, address, refit)
        done = {"type": "complete", "version": version, "names": len(layout.slots)}
        _request(sock, done | {"buckets": headers}, "the end of the refit", address)
    except BaseException:
        link.reset()
        raise
    finally:
        sock.close()
        remove_socket_file(address)
    return RefitReport.of(layout, version, time.perf_counter() - start, use_checksum)


def _write_direct(target: torch.Tensor, r: _Refit) -> list[dict[str, Any]]:
    """Pack every bucket into `target`, the receiver's staging bytes; the buckets' headers."""
    layout = r.layout
    if target.numel() < layout.total:
        raise RefitError(
            f"refit: the receiver's staging holds {target.numel()} bytes, the layout {layout.total}"
        )
    headers = []
    for bucket in layout.buckets:
        region = target[bucket.start : bucket.end]
        pack(bucket, region, r.tensors)
        # kept on the device: one synchronization for the whole refit, not one per bucket
        total = checksum_on_device(region) if r.use_checksum else None
        headers.append(bucket_header(bucket, r.version, total))
    if r.device.type == "cuda":  # the bytes are there before "complete"
        torch.cuda.current_stream(r.device).synchronize()
    for header in headers:
        if header["checksum"] is not None:
            header["checksum"] = int(header["checksum"])
    return headers


def _send_buffered(sock: zmq.Socket, address: str, r: _Refit) -> list[dict[str, Any]]:
    """Every bucket through two ping-pong buffers, acked one by one; no headers left to send."""
    layout, device = r.layout, r.device
    # Two buffers of the largest regular bucket (at most the bucket size); larger tensors get
    # a buffer of their own.
    size = layout.buffer_bytes
    buffers = [SharedBuffer(size, device) for _ in range(2)] if size else []
    in_flight: _Pending | None = None  # sent, its ack not yet received
    try:
        for bucket in layout.buckets:
            own = bucket.nbytes > size
            # this buffer's previous bucket (index - 2) was acked before the last send
            buf = SharedBuffer(bucket.nbytes, device) if own else buffers[bucket.index % 2]
            try:
                header = _pack(bucket, buf, r)
            except BaseException:
                if own:
                    buf.close()
                raise
            if in_flight is not None:  # the receiver staged it while we packed this one
                _ack(sock, in_flight, address)
            in_flight = _Pending(header, buf, own)
            _post(sock, header, address)
        if in_flight is not None:
            last, in_flight = in_flight, None
            _ack(sock, last, address)
    finally:
        if in_flight is not None and in_flight.own:
            in_flight.buffer.close()  # sent but never acked (idempotent when it was)
        for buf in buffers:
            buf.close()
    return []


def _post(sock: zmq.Socket, header: dict[str, Any], peer: str) -> None:
    """Send a bucket's header; its ack is received later (`_ack`), after the next bucket is
    packed, so that packing and the receiver's staging overlap."""
    try:
        sock.send_json(header)
    except zmq.Again:
        raise RefitError(  # a REQ socket cannot send while its peer is gone
            f"refit: the receiver at {peer} did not answer bucket {header['index']} in time "
            "(timeout: it is not connected)"
        ) from None


def _ack(sock: zmq.Socket, sent: _Pending, peer: str) -> None:
    """Wait for the receiver's answer to `sent`; its own buffer (if any) is freed after."""
    try:
        _answer(sock, f"bucket {sent.header['index']}", peer)
    finally:
        if sent.own:
            sent.buffer.close()


def _pack(bucket: Bucket, buf: SharedBuffer, r: _Refit) -> dict[str, Any]:
    """Copy the bucket's tensors into `buf` at their layout offsets; its header."""
    pack(bucket, buf.tensor, r.tensors)
    data = buf.tensor[: bucket.nbytes]
    total = checksum(data) if r.use_checksum else None  # syncs the device when computed
    if r.device.type == "cuda":
        torch.cuda.current_stream(r.device).synchronize()  # the bytes are there before the header
    return bucket_header(bucket, r.version, total) | {"buffer": buf.handle()}


def receive_ipc(staging: Staging, *, address: str, timeout_s: float) -> int:
    """One refit from the sender bound at `address` into `staging`; returns its version.

    Raises `RefitError` (after answering the sender, if it is there) on a timeout, a mismatch or
    a failed checksum; the live weights then stay at the previous version.
    """
    check_private(address)
    sock = _socket(zmq.REP, timeout_s)
    # The receiver usually connects before the trainer binds; ZMQ then retries the connection
    # every RECONNECT_IVL (100 ms by default), which was most of a refit's time. Retry each ms.
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
    sock.connect(address)
    mapped: dict[str, MappedBuffer] = {}
    try:
        while True:
            try:
                message = _receive(sock, address, staging.version)
                version = _step(staging, message, mapped, sock)
            except RefitError as e:
                with contextlib.suppress(zmq.ZMQError):  # a REP socket answers what it received
                    sock.send_json({"ok": False, "error": str(e)})
                raise
            if version is not None:
                return version
    finally:
        for buf in mapped.values():
            buf.close()
        sock.close()


def _step(
    staging: Staging, message: dict[str, Any], mapped: dict[str, MappedBuffer], sock: zmq.Socket
) -> int | None:
    """Handle one message (answered when handled); the version applied by "complete". A
    malformed message is a `RefitError`."""
    try:
        kind = message["type"]
        if kind == "begin":
            staging.begin(message["version"], message["slots"])
            sock.send_json({"ok": True, "staging": staging.share()})
        elif kind == "bucket":  # through the trainer's buffers
            buf = _mapped(mapped, message["buffer"])
            staging.stage(message, buf.tensor)
            sock.send_json({"ok": True})
        elif kind == "complete":  # the headers of buckets written into our staging, if any
            for header in message["buckets"]:
                staging.verify_in_place(header)
            staging.commit(message["version"])
            sock.send_json({"ok": True, "version": message["version"]})
            return message["version"]
        else:
            raise RefitError(f"refit: a message of unknown type {kind!r}")
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise RefitError(f"refit: a malformed message ({type(e).__name__}: {e})") from None
    return None


def _receive(sock: zmq.Socket, peer: str, version: int | None) -> dict[str, Any]:
    try:
        return _json(sock.recv())
    except zmq.Again:
        raise RefitError(
            f"refit: no message from the trainer at {peer} in time (timeout); the live weights "
            f"are unchanged (version {version})"
        ) from None


def _mapped(cache: dict[str, MappedBuffer], handle: dict[str, Any]) -> MappedBuffer:
    """Map each distinct buffer once per refit (the two ping-pong buffers come back often)."""
    key = repr(handle.get("path") or handle.get("ipc"))
    if key not in cache:
        cache[key] = MappedBuffer(handle)
    return cache[key]
