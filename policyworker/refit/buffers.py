"""Transfer buffers another process can map: a CUDA IPC handle on GPU, a shared memory file on CPU.

The two kinds are one protocol: the sender describes a buffer with `handle()` (a small picklable
dict) and the receiver maps it with `MappedBuffer(handle)`; both sides then see the same bytes. On
CPU this lets CI run the exact protocol that a colocated GPU refit runs.
"""

from __future__ import annotations

import contextlib
import glob
import os
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
            self._handle: dict[str, Any] = {"kind": "cuda", "args": reduce_tensor(self.tensor)[1]}
        else:  # a file in shared memory, mapped by both sides
            self._path = os.path.join(_SHM_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
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
        return {"kind": "cuda", "args": reduce_tensor(self.tensor)[1], "nbytes": self.nbytes}

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
        if handle["kind"] == "cuda":
            self.tensor = rebuild_cuda_tensor(*handle["args"])
        else:
            self.tensor = _map(handle["path"], handle["nbytes"])

    def close(self) -> None:
        del self.tensor


_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_PREFIX = "policyworker-refit-"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_leftovers(pid: int) -> None:
    """Remove the CPU buffers of process `pid`, which died without cleaning up (killed)."""
    for path in glob.glob(os.path.join(_SHM_DIR, f"{_PREFIX}{pid}-*")):
        _unlink(path)


def sweep_dead() -> None:
    """Remove the shared buffers and IPC socket files that processes which no longer exist
    left behind (killed mid-refit: nothing of theirs could clean up)."""
    paths = glob.glob(os.path.join(_SHM_DIR, f"{_PREFIX}*-*"))
    paths += glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}*-*.sock"))
    for path in paths:
        pid = os.path.basename(path)[len(_PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
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
