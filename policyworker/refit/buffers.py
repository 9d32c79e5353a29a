"""Transfer buffers another process can map: a CUDA IPC handle on GPU, a shared memory file on CPU.

The two kinds are one protocol: the sender describes a buffer with `handle()` (a small dict of
JSON values: ints, strings, hex bytes — never a pickle) and the receiver maps it with
`MappedBuffer(handle)`; both sides then see the same bytes. On CPU this lets CI run the exact
protocol that a colocated GPU refit runs. A receiver maps only a shared-memory file of ours
(this module's folder and prefix), and rebuilds a CUDA handle as a uint8 tensor whatever the
handle says.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import uuid
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from policyworker.refit.layout import RefitError


class SharedBuffer:
    """A uint8 buffer of `nbytes` on `device` that another process can map."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self._closed = False
        self._path: str | None = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._handle: dict[str, Any] = _cuda_handle(self.tensor)
        else:  # a file in shared memory, mapped by both sides
            self._path = os.path.join(_SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
            _allocate(self._path, nbytes)
            self.tensor = _map(self._path, nbytes)
            self._handle = {"kind": "shm", "path": self._path}
            weakref.finalize(self, _unlink, self._path)  # also at exit; see remove_leftovers
        self._handle["nbytes"] = nbytes

    def handle(self) -> dict[str, Any]:
        return self._handle

    def share(self) -> dict[str, Any]:
        """A handle for one more mapping by another process. A CUDA buffer mapped again (a
        receiver's staging, shared every refit) needs a fresh one: each IPC share is counted."""
        if self._path is not None:
            return self._handle
        return _cuda_handle(self.tensor) | {"nbytes": self.nbytes}

    def close(self) -> None:
        """Free the buffer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        del self.tensor
        if self._path is not None:  # a receiver's mapping outlives the name
            _unlink(self._path)


class MappedBuffer:
    """The receiver's view of a `SharedBuffer`."""

    def __init__(self, handle: dict[str, Any]) -> None:
        """Raises `RefitError` for a handle that is not one of a `SharedBuffer`'s."""
        try:
            kind, nbytes = handle["kind"], handle["nbytes"]
            if not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(f"nbytes {nbytes!r}")
            if kind == "cuda":
                self.tensor = _rebuild_cuda(handle)
            elif kind == "shm":
                self.tensor = _map(_our_file(handle["path"]), nbytes)
            else:
                raise ValueError(f"kind {kind!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise RefitError(f"refit: not a shared buffer's handle ({e!r})") from None

    def close(self) -> None:
        del self.tensor


_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "policyworker-refit-"


def _our_file(path: object) -> str:
    """`path` if it names one of our buffer files (no other file is ever mapped)."""
    if not isinstance(path, str) or os.path.dirname(path) != _SHM_DIR:
        raise ValueError(f"path {path!r} is not in {_SHM_DIR}")
    if not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"path {path!r} is not a refit buffer")
    return path


def _cuda_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """A CUDA IPC handle of `tensor` (uint8, 1-D) as JSON values: torch's own sharing
    (`reduce_tensor`) with its classes and dtype left out (the receiver knows them) and its
    byte strings as hex."""
    _, size, stride, offset, _, _, device, *rest = reduce_tensor(tensor)[1]
    handle, storage_bytes, storage_offset, _, counter, counter_offset, event, event_sync = rest
    return {
        "kind": "cuda",
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "device": device,
        "ipc": [_hex(handle), storage_bytes, storage_offset],
        "counter": [_hex(counter), counter_offset],
        "event": [_hex(event), event_sync],
        "nbytes": tensor.numel(),
    }


def _rebuild_cuda(h: dict[str, Any]) -> torch.Tensor:
    (handle, storage_bytes, storage_offset), (counter, counter_offset) = h["ipc"], h["counter"]
    event, event_sync = h["event"]
    return rebuild_cuda_tensor(
        torch.Tensor,
        tuple(h["size"]),
        tuple(h["stride"]),
        int(h["offset"]),
        torch.storage.TypedStorage,
        torch.uint8,
        int(h["device"]),
        _bytes(handle),
        int(storage_bytes),
        int(storage_offset),
        False,
        _bytes(counter),
        int(counter_offset),
        _bytes(event),
        bool(event_sync),
    )


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else bytes.fromhex(value)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_leftovers(pid: int) -> None:
    """Remove the CPU buffers of process `pid`, which died without cleaning up (killed)."""
    for path in glob.glob(os.path.join(_SHM_DIR, f"{PREFIX}{pid}-*")):
        _unlink(path)


def sweep_dead() -> None:
    """Remove the shared buffers and IPC endpoint folders that processes which no longer exist
    left behind (killed mid-refit: nothing of theirs could clean up); another user's stay."""
    paths = {*glob.glob(os.path.join(_SHM_DIR, f"{PREFIX}*-*"))}
    paths |= {*glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}*-*"))}
    for path in paths:
        pid = os.path.basename(path)[len(PREFIX) :].split("-")[0]
        with contextlib.suppress(OSError):  # gone meanwhile
            if not pid.isdigit() or _alive(int(pid)) or os.lstat(path).st_uid != os.getuid():
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                _unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _allocate(path: str, nbytes: int) -> None:
    """Create the file with all its bytes reserved: a full /dev/shm is then an error here, not
    a SIGBUS when a mapped page is first written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as e:
        _unlink(path)
        free = os.statvfs(_SHM_DIR)
        raise RefitError(
            f"refit: {_SHM_DIR} has no room for a shared buffer of {nbytes} bytes "
            f"({free.f_bavail * free.f_frsize} bytes free: {e.strerror}); enlarge it (docker: "
            "--shm-size) or lower refit.buffer_size_bytes"
        ) from None
    finally:
        os.close(fd)


def _map(path: str, nbytes: int) -> torch.Tensor:
    """`nbytes` of the file at `path` (created if absent), mapped shared: writes are seen by
    every process that maps it."""
    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
