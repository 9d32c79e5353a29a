"""A save's writes: the writer threads, what they report, and the clean-up of a failed save.

megatron-core plans each directory's write (`dist_checkpointing.save(..., async_sharded_save=
True)` gives the files' buckets); the buckets are written here, one thread each, started when
the save is made. A failed save leaves nothing behind: its temporary directories are removed and
the error names the directory and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from torch.distributed.checkpoint.api import CheckpointException

from policyworker.checkpoint.commit import CheckpointSaveError, Tmp, fault_point, rank


@dataclass(slots=True)
class PendingSave:
    """A save between its planning and its commit: the write requests, the temporary and
    target directories, the writer threads and what they reported."""

    requests: list[tuple[AsyncRequest, list[Any]]]
    commits: list[tuple[Path, Path, dict[str, Any]]]  # (tmp, target, manifest)
    tmps: list[Tmp] = field(default_factory=list)
    """The temporary folders (and the folders made for them), for a failed save to remove."""
    writers: list[threading.Thread] = field(default_factory=list)
    outputs: list[dict[int, Any]] = field(default_factory=list)
    """Per request, each write bucket's results (or exception) by bucket index."""
    errors: list[BaseException] = field(default_factory=list)


def start_writes(pending: PendingSave) -> None:
    """One writer thread per write bucket of every request, started now.

    Our threads rather than megatron's writer function, which starts its threads when it runs:
    a process whose script ends with an async save pending finalizes it at exit, when Python
    (3.12) no longer starts threads — these are running by then."""
    for r, (request, args) in enumerate(pending.requests):
        pending.outputs.append({})
        if request.async_fn is None:
            continue  # nothing of this directory on this rank
        transforms, use_msc = request.async_fn.args[:2]
        for i, bucket in enumerate(args[1]):
            kwargs = {"use_msc": use_msc} if use_msc else {}
            thread = threading.Thread(
                target=_write_bucket,
                args=(pending, r, i, (transforms, i, bucket, None, None, True), kwargs),
                name=f"checkpoint-writer-{r}.{i}",
                daemon=True,
            )
            thread.start()
            pending.writers.append(thread)


def _write_bucket(
    pending: PendingSave, request: int, index: int, args: tuple, kwargs: dict[str, Any]
) -> None:
    try:
        _, result = filesystem_async.FileSystemWriterAsync.write_preloaded_data(*args, **kwargs)
    except BaseException as e:
        result = e
    if isinstance(result, BaseException):
        pending.errors.append(result)
    pending.outputs[request][index] = result
    if request == 0 and index == 0:
        fault_point("checkpoint.write")  # the first file of the weights is written


def join_writes(pending: PendingSave) -> None:
    """Wait for the writers; hand each request's results to megatron's finalization (the
    queue its writer function would have filled)."""
    for thread in pending.writers:
        thread.join()
    pending.writers = []
    for (request, args), outputs in zip(pending.requests, pending.outputs, strict=True):
        if request.async_fn is not None:
            error = next((o for o in outputs.values() if isinstance(o, BaseException)), None)
            args[2].put(error if error is not None else outputs)


def first_error(errors: list[BaseException]) -> str | None:
    return f"{type(errors[0]).__name__}: {errors[0]}" if errors else None


def failure(pending: PendingSave, error: BaseException) -> BaseException:
    """Remove a failed save's temporary directories; the error to raise for it (an interrupt
    stays what it is)."""
    full = _disk_full(pending, error)
    _clear_frames(error, *pending.errors)
    discard(pending)
    if not isinstance(error, Exception | CheckpointException):
        return error
    target = pending.commits[0][1] if pending.commits else "?"
    reason = full or (str(error).strip().splitlines() or [type(error).__name__])[0][:500]
    return CheckpointSaveError(
        f"save to {target} failed: {reason}; nothing was committed (the previous checkpoints "
        "are untouched) and its temporary files are removed"
    )


def _clear_frames(*errors: BaseException) -> None:
    """Drop the locals of the failed writes' frames (the messages and line numbers stay).

    torch's writer serializes into a BytesIO and writes a memoryview of its buffer; a failure
    leaves both in the frames of its traceback, a reference cycle that only the garbage
    collector frees, and CPython 3.12.1 can crash freeing such a pair there (the buffer
    released after its BytesIO was cleared: a segmentation fault seen after a save into a
    full file system). Cleared here, they go by reference counting, in a safe order."""
    seen: set[int] = set()
    for root in errors:
        e: BaseException | None = root
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)  # executing frames are skipped
            e = e.__cause__ or e.__context__


def _disk_full(pending: PendingSave, error: BaseException) -> str | None:
    """ "no space left on device ..." when that is why the save failed: an ENOSPC anywhere in
    the failures' cause chains, or (megatron's finalization reports only what failed, not why)
    a file system with less than 1 MiB left."""
    nospace = False
    for root in (error, *pending.errors):
        e: BaseException | None = root
        while e is not None:
            nospace |= isinstance(e, OSError) and e.errno == errno.ENOSPC
            e = e.__cause__ or e.__context__
    for tmp, target, _ in pending.commits:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(tmp).free
            if nospace or free < (1 << 20):
                return f"no space left on device under {target.parent} ({free} bytes free)"
    return "no space left on device" if nospace else None


def discard(pending: PendingSave) -> None:
    """Rank 0 removes the save's temporary directories (never a committed one)."""
    if rank() != 0:
        return
    for tmp in reversed(pending.tmps):  # the weights' last: their parents may be shared
        tmp.discard()
