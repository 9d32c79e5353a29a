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


def test_the_receiver_never_unpickles_a_message(tmp_path):
    """A peer speaking as the trainer with a pickle gets a refusal; the pickle never runs and
    the live weights stay."""
    address = private_endpoint("evil-trainer.sock")
    marker = tmp_path / "ran"
    answers: list[object] = []

    def evil_trainer() -> None:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.bind(address)
        sock.send(pickle.dumps(_Evil(marker)))
        answers.append(sock.recv_json())
        sock.close()
        remove_socket_file(address)

    staging, live = _staging()
    peer = threading.Thread(target=evil_trainer)
    peer.start()
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
    address = private_endpoint("malformed.sock")
    answers: list[object] = []

    def peer() -> None:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.bind(address)
        sock.send_json(message)
        answers.append(sock.recv_json())
        sock.close()
        remove_socket_file(address)

    staging, _ = _staging()
    thread = threading.Thread(target=peer)
    thread.start()
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
