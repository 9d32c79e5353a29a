"""Transfer buffers another process can map: a CUDA IPC handle on GPU, a shared memory file on CPU.

The two kinds are one protocol: the sender describes a buffer with `handle()` (a small picklable
dict) and the receiver maps it with `open_buffer(handle)`; both sides then see the same bytes. On
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


def _map(path: str, nbytes: int) -> torch.Tensor:
    """`nbytes` of the file at `path` (created if absent), mapped shared: writes are seen by
    every process that maps it."""
    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
