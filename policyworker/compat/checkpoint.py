"""An in-process results queue for megatron-core 0.19's dist-checkpointing writer.

Its writer hands each save's write results to the finalization through a module-level queue that
a spawned multiprocessing Manager serves (`filesystem_async.get_write_results_queue`): a helper
process that re-imports the caller's `__main__` (a script without a main guard runs twice) and
outlives a killed trainer. Our writes run in this process (`checkpoint.writes`), so a plain
thread-safe queue serves; a fresh one per save leaves no result of a failed save behind. The
writer keeps the queue it was planned with, so the module's own is restored right after.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator

from policyworker.compat.version import require_mcore


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """While planning a save: the writers it plans report through an in-process queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    require_mcore("checkpoint", "get_write_results_queue")
    saved = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved
