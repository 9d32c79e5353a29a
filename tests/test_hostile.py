"""Hostile peers and local strangers against the refit transports: nothing off a socket is
unpickled, the trainer's IPC endpoint is private to its user, a receiver maps only our own
buffers (issue 51's security findings, one test each)."""

from __future__ import annotations

import os
import pickle
import socket
import stat
import threading
from pathlib import Path

import pytest
import torch
import zmq

from policyworker.refit.buffers import MappedBuffer
from policyworker.refit.ipc import (
    IpcLink,
    check_private,
    private_endpoint,
    receive_ipc,
    remove_socket_file,
    send_ipc,
)
from policyworker.refit.layout import Layout, RefitError
from policyworker.refit.receiver import Staging

INFO = {"w": ((4, 4), torch.float32)}


class _Evil:
    """Unpickling it creates `path`: the proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def _staging() -> tuple[Staging, dict[str, torch.Tensor]]:
    live = {"w": torch.zeros(4, 4)}
    return Staging(INFO, live), live


def _as_trainer(address: str, frame: bytes, answers: list[object]) -> threading.Thread:
    """A peer speaking as the trainer: binds `address`, sends `frame`, keeps the answer."""

    def run() -> None:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.bind(address)
        sock.send(frame)
        answers.append(sock.recv_json())
        sock.close()
        remove_socket_file(address)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_receiver_never_unpickles_a_message(tmp_path):
    """A peer speaking as the trainer with a pickle gets a refusal; the pickle never runs and
    the live weights stay."""
    address = private_endpoint("evil-trainer.sock")
    marker = tmp_path / "ran"
    answers: list[object] = []
    staging, live = _staging()
    peer = _as_trainer(address, pickle.dumps(_Evil(marker)), answers)
    with pytest.raises(RefitError, match="not a JSON object"):
        receive_ipc(staging, address=address, timeout_s=5.0)
    peer.join(10)
    assert not marker.exists()
    assert answers and answers[0]["ok"] is False
    assert torch.equal(live["w"], torch.zeros(4, 4)) and staging.version is None


@pytest.mark.parametrize(
    "message,match",
    [
        ({"type": "begin"}, "malformed"),
        ({"type": "bucket", "version": 1, "buffer": "x"}, "malformed|not a shared buffer"),
        ({"type": "explode"}, "unknown type"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_malformed_message_is_a_refit_error_with_a_reply(message, match):
    import json

    address = private_endpoint("malformed.sock")
    answers: list[object] = []
    staging, _ = _staging()
    thread = _as_trainer(address, json.dumps(message).encode(), answers)
    with pytest.raises(RefitError, match=match):
        receive_ipc(staging, address=address, timeout_s=5.0)
    thread.join(10)
    assert answers and answers[0]["ok"] is False


def test_the_trainer_never_unpickles_a_reply(tmp_path):
    """A peer speaking as the receiver answers the trainer with a pickle: a `RefitError`."""
    address = private_endpoint("evil-receiver.sock")
    marker = tmp_path / "ran"

    def evil_receiver() -> None:
        sock = zmq.Context.instance().socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(address)
        sock.recv()
        sock.send(pickle.dumps(_Evil(marker)))
        sock.close()

    peer = threading.Thread(target=evil_receiver)
    peer.start()
    tensors = iter([("w", torch.ones(4, 4))])
    with pytest.raises(RefitError, match="not a JSON object"):
        send_ipc(
            tensors, Layout(INFO, None), link=IpcLink(address), version=1, timeout_s=5.0,
            use_checksum=False, device=torch.device("cpu"),
        )  # fmt: skip
    peer.join(10)
    assert not marker.exists()


def test_the_endpoint_is_private_and_never_bound_over():
    address = private_endpoint("private.sock")
    path = address[len("ipc://") :]
    folder = os.stat(os.path.dirname(path))
    assert folder.st_uid == os.getuid() and stat.S_IMODE(folder.st_mode) == 0o700
    old = os.umask(0)  # the hostile run's umask: the socket was 0777
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        from policyworker.refit.ipc import _bind

        _bind(sock, address)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        other = zmq.Context.instance().socket(zmq.REQ)
        with pytest.raises(RefitError, match="refusing to bind over it"):
            _bind(other, address)
        other.close(linger=0)
    finally:
        os.umask(old)
        sock.close(linger=0)
        remove_socket_file(address)


def test_an_endpoint_others_can_reach_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    for address in (f"ipc://{shared}/x.sock", "ipc:///tmp/policyworker-guessable.sock"):
        with pytest.raises(RefitError, match="refusing the endpoint"):
            check_private(address)
        staging, _ = _staging()
        with pytest.raises(RefitError, match="refusing the endpoint"):
            receive_ipc(staging, address=address, timeout_s=1.0)


@pytest.mark.processes
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as nobody")
def test_another_user_cannot_reach_the_endpoint():
    address = private_endpoint("stranger.sock")
    path = address[len("ipc://") :]
    sock = zmq.Context.instance().socket(zmq.REQ)
    from policyworker.refit.ipc import _bind

    _bind(sock, address)
    try:
        pid = os.fork()  # the child only makes system calls, then leaves without cleanup
        if pid == 0:
            os.setgid(65534)
            os.setuid(65534)
            code = 1
            try:
                socket.socket(socket.AF_UNIX).connect(path)
            except PermissionError:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3  # refused: the folder is 0700
    finally:
        sock.close(linger=0)
        remove_socket_file(address)


def test_a_receiver_maps_only_our_shared_buffers(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    for handle in (
        {"kind": "shm", "path": str(secret), "nbytes": 64},
        {"kind": "shm", "path": "/dev/shm/../etc/passwd", "nbytes": 8},
        {"kind": "shm", "path": "/dev/shm/not-ours", "nbytes": 8},
        {"kind": "cuda", "nbytes": 8},
        {"kind": "pickle", "nbytes": 8},
        {"kind": "shm", "path": "/dev/shm/policyworker-refit-1", "nbytes": -1},
    ):
        with pytest.raises(RefitError, match="not a shared buffer"):
            MappedBuffer(handle)


# --- the sparse TCP receiver --------------------------------------------------------------------

KEY = "this run's key"
W = {"w": ((4, 32), torch.bfloat16)}


def _sparse_receiver():
    from policyworker.refit.sparse_receiver import SparseReceiver

    live = {"w": torch.zeros(4, 32, dtype=torch.bfloat16)}
    return SparseReceiver(live, W, api_key=KEY), live


def _frames(kind: bytes, meta: dict, *rest: bytes, key: str | None = KEY) -> list[bytes]:
    import json

    from policyworker.refit.sparse_link import signed

    frames = [kind, json.dumps(meta).encode(), *rest]
    return frames if key is None else signed(key.encode(), frames)


def _dealer(address: str):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _replies(sock, n: int) -> list[dict]:
    import json

    out = []
    for _ in range(n):
        assert sock.poll(5000), "no reply"
        out.append(json.loads(sock.recv_multipart()[1]))
    return out


def _payload(value: float) -> tuple[bytes, int]:
    from policyworker.refit.sparse_codec import delta, encode

    base = torch.zeros(4, 32, dtype=torch.bfloat16)
    return encode([delta("w", torch.full((4, 32), value, dtype=torch.bfloat16), base)])


def test_unsigned_or_wrongly_signed_messages_change_nothing_and_abort_nothing():
    """A stranger's DATA + DONE (no key, the wrong key, a key in the meta as before) during a
    keyed transfer: each refused on its own; the trainer's own messages then complete it."""
    receiver, live = _sparse_receiver()
    zeros, crc0 = _payload(0.0)
    good, crc = _payload(1.0)
    meta = {"transfer": "t", "producer": 0, "payload": 0, "base_version": 0, "crc": crc0}
    stranger, trainer = _dealer(receiver.address), _dealer(receiver.address)
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(receiver.receive("t", 1, timeout_s=10)))
    thread.start()
    try:
        for key in (None, "guessed"):
            stranger.send_multipart(_frames(b"DATA", meta | {"key": KEY}, zeros, key=key))
            stranger.send_multipart(_frames(b"DONE", meta | {"payloads": 1}, key=key))
        stranger.send_multipart([b"DATA"])  # malformed: answered too
        refusals = _replies(stranger, 5)  # each answered while the transfer goes on
        assert all(not r["ok"] for r in refusals) and "not signed" in refusals[0]["error"]
        assert not done and not live["w"].any()
        trainer.send_multipart(_frames(b"DATA", meta | {"crc": crc}, good))
        trainer.send_multipart(_frames(b"DONE", meta | {"payloads": 1}))
        thread.join(10)
        assert done == [1] and all(r["ok"] for r in _replies(trainer, 2))
        assert torch.equal(live["w"], torch.ones(4, 32, dtype=torch.bfloat16))
    finally:
        stranger.close(linger=0)
        trainer.close(linger=0)
        receiver.close()


def test_a_stray_message_never_breaks_the_next_transfers():
    """A message that arrives while no transfer runs (a late trainer's, of transfer "old") is
    refused when the next transfer starts, which completes; and the one after it too."""
    receiver, _ = _sparse_receiver()
    body, crc = _payload(2.0)
    sock = _dealer(receiver.address)
    try:
        sock.send_multipart(_frames(b"DATA", {"transfer": "old", "producer": 0, "payload": 0,
                                              "base_version": 0, "crc": crc}, body))  # fmt: skip
        for version, transfer in ((1, "a"), (2, "b")):
            meta = {"transfer": transfer, "producer": 0, "payload": 0,
                    "base_version": version - 1, "crc": crc}  # fmt: skip
            sock.send_multipart(_frames(b"DATA", meta, body))
            sock.send_multipart(_frames(b"DONE", meta | {"payloads": 1}))
            assert receiver.receive(transfer, 1, timeout_s=5) == version
        replies = _replies(sock, 5)
        assert not replies[0]["ok"] and "stale or foreign" in replies[0]["error"]
        assert all(r["ok"] for r in replies[1:])
    finally:
        sock.close(linger=0)
        receiver.close()


@pytest.mark.parametrize(
    "meta,match",
    [
        ({"producer": 5}, r"producer: expected an int in \[0, 1\)"),
        ({"producer": -1}, "producer: expected"),
        ({"base_version": 1e6, "full": True}, "base_version: expected an int"),
        ({"full": "yes"}, "full: expected true or false"),
        ({"payloads": -3}, "payloads: expected"),
    ],
)
def test_signed_messages_out_of_range_end_the_transfer_with_nothing_applied(meta, match):
    """A DONE from producer 5 of a 1-producer transfer completed it with nothing applied; a
    full resync's base_version 1e6 jumped the engine to version 1000001."""
    from policyworker.refit.layout import RefitError

    receiver, live = _sparse_receiver()
    sock = _dealer(receiver.address)
    try:
        base = {"transfer": "t", "producer": 0, "base_version": 0, "payloads": 0}
        sock.send_multipart(_frames(b"DONE", base | meta))
        with pytest.raises(RefitError, match=match):
            receiver.receive("t", 1, timeout_s=5)
        assert receiver.version == 0 and not live["w"].any()
        assert not _replies(sock, 1)[0]["ok"]
    finally:
        sock.close(linger=0)
        receiver.close()


def test_the_relay_tree_is_the_receivers_own_not_the_messages():
    """A signed message naming a tree of other hosts (or of this receiver twice) relays to no
    one: the receiver relays only to the children of the tree it was started with."""
    receiver, _ = _sparse_receiver()
    body, crc = _payload(1.0)
    meta = {"transfer": "t", "producer": 0, "payload": 0, "base_version": 0, "crc": crc,
            "tree": [receiver.address, "tcp://10.255.255.1:9", receiver.address]}  # fmt: skip
    sock = _dealer(receiver.address)
    try:
        sock.send_multipart(_frames(b"DATA", meta, body))
        sock.send_multipart(_frames(b"DONE", meta | {"payloads": 1}))
        assert receiver.receive("t", 1, timeout_s=5) == 1
        assert receiver._children == {}
        with pytest.raises(ValueError, match="tree"):
            receiver.receive("u", 1, timeout_s=1, tree=["tcp://10.255.255.1:9"])
    finally:
        sock.close(linger=0)
        receiver.close()


def test_a_decompression_bomb_or_an_oversized_frame_allocates_nothing_large():
    """A signed 512 MiB zstd bomb (a few KB on the wire) is refused after reading what the
    receiver's tensors can hold; a 64 MiB raw frame is cut off by the socket's size limit.
    Neither grows the process by more than a fraction of it; a good transfer follows."""
    import json
    import resource
    import zlib

    import zstandard

    from policyworker.refit.layout import RefitError

    receiver, _ = _sparse_receiver()
    head = json.dumps([["w", [4, 32], "bfloat16", 128, "dense"]]).encode()
    bomb = zstandard.ZstdCompressor().compress(
        len(head).to_bytes(4, "little") + head + bytes(512 << 20)
    )
    assert len(bomb) < 100_000
    meta = {"transfer": "t", "producer": 0, "payload": 0, "base_version": 0,
            "crc": zlib.crc32(bomb)}  # fmt: skip
    big, sock = _dealer(receiver.address), _dealer(receiver.address)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    try:
        big.send_multipart([b"DATA", b"{}", bytes(64 << 20)])
        sock.send_multipart(_frames(b"DATA", meta, bomb))
        with pytest.raises(RefitError, match="trailing bytes"):
            receiver.receive("t", 1, timeout_s=5)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert grown < 200 * 1024, f"grew {grown} KiB"
        body, crc = _payload(1.0)
        good = meta | {"transfer": "u", "crc": crc}
        sock.send_multipart(_frames(b"DATA", good, body))
        sock.send_multipart(_frames(b"DONE", good | {"payloads": 1}))
        assert receiver.receive("u", 1, timeout_s=5) == 1
    finally:
        big.close(linger=0)
        sock.close(linger=0)
        receiver.close()


def test_the_sparse_key_is_mandatory_on_both_sides():
    from policyworker.refit.sparse import stream, take_baseline
    from policyworker.refit.sparse_receiver import SparseReceiver

    live = {"w": torch.zeros(4, 32, dtype=torch.bfloat16)}
    for key in (None, ""):
        with pytest.raises(ValueError, match="api_key: the sparse refit signs every message"):
            SparseReceiver(live, W, api_key=key)  # type: ignore[arg-type]
    from policyworker.refit.sparse import Shard

    source = take_baseline(iter(live.items()), Shard(0, 1))
    with pytest.raises(ValueError, match="api_key"):
        stream(source, iter(live.items()), ["tcp://127.0.0.1:1"], transfer_id="t",
               timeout_s=1, api_key=None)  # type: ignore[arg-type]  # fmt: skip


# --- the rendezvous stores ----------------------------------------------------------------------

_LISTENING = """
import json, os, psutil
from policyworker.parallel.dims import init_distributed
init_distributed()
print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN]))
"""


@pytest.mark.processes
def test_the_rendezvous_store_listens_on_master_addr_alone():
    """A worker's (or a Policy rank 0's) torch.distributed store listened on every interface
    (`*:port`) even with MASTER_ADDR=127.0.0.1: a stranger on another interface could set keys
    in it. Now on MASTER_ADDR alone (the collective and reshard refit groups' stores too:
    `parallel.dims.tcp_store`)."""
    import json
    import subprocess
    import sys

    from helpers import clean_env

    env = clean_env() | {"MASTER_ADDR": "127.0.0.1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    run = subprocess.run(
        [sys.executable, "-c", _LISTENING], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    listening = json.loads(run.stdout.strip().splitlines()[-1])
    assert listening and set(listening) == {"127.0.0.1"}, listening


def test_a_refit_group_store_listens_on_its_host_alone():
    import datetime

    import psutil

    from policyworker.parallel.dims import free_port, tcp_store

    port = free_port("127.0.0.1")
    store = tcp_store("127.0.0.1", port, 1, True, datetime.timedelta(seconds=10))
    store.set("k", "v")
    mine = [c for c in psutil.Process().net_connections(kind="inet") if c.laddr.port == port]
    assert mine and {c.laddr.ip for c in mine if c.status == psutil.CONN_LISTEN} == {"127.0.0.1"}
    del store
