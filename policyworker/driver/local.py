"""The local backend: one spawned process per rank on this machine, `rpc` requests over pipes.

Tensors travel by value (`wire`): for the batches a call carries this is faster than
multiprocessing's default of one shared-memory file per tensor, and leaves no such files.

A rank's death shows as its process sentinel becoming ready, so a killed worker fails the call
at once instead of leaving the driver waiting on its pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any

from policyworker import rpc
from policyworker.driver.group import Answers, GroupState, WorkerError
from policyworker.driver.worker_side import START, serve
from policyworker.parallel.dims import free_port


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` added to this process's environment while a child is spawned (it inherits it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class LocalGroup(GroupState):
    """`world_size` worker processes of this machine (one GPU each where there are GPUs)."""

    def __init__(
        self,
        world_size: int,
        *,
        envs: list[dict[str, str]],
        log_levels: dict[str, int],
        failure_timeout_s: float,
        call_timeout_s: float | None,
    ) -> None:
        super().__init__(world_size, failure_timeout_s, call_timeout_s)
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._pipes: list[rpc.Pipe] = []
        self._procs: list[mp.process.BaseProcess] = []
        master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        for env in envs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, {**env, **master}, log_levels))
            proc.daemon = True  # never outlives the driver
            with _environ({**env, **master}):  # from the interpreter's start, as torchrun does
                proc.start()
            child.close()
            self._pipes.append(rpc.Pipe(parent))
            self._procs.append(proc)
        self.pids = [p.pid or 0 for p in self._procs]

    def start(self, kwargs: dict[str, Any], timeout_s: float) -> None:
        answers = self._answers(START, timeout_s, check=False)
        self._call(answers, self._requests(answers, [kwargs] * self.world_size))

    def run(self, call: str, kwargs: list[dict[str, Any]]) -> list[Any]:
        answers = self._answers(call, self.call_timeout_s)
        return self._call(answers, self._requests(answers, kwargs))

    @staticmethod
    def _requests(answers: Answers, kwargs: list[dict[str, Any]]) -> list[rpc.Request]:
        """Every rank's request, pickled before any is sent (arguments that do not pickle fail
        the call with nothing sent)."""
        return [rpc.request(answers.call_id, answers.call, kw) for kw in kwargs]

    def _send(self, rank: int, answers: Answers, request: rpc.Request) -> None:
        try:
            self._pipes[rank].send(request, answers.call)
        except (BrokenPipeError, OSError) as e:
            answers.died(rank, f"its process is gone ({e!r})")

    def _collect(self, answers: Answers) -> None:
        answers.drain()
        while not answers.done():
            wait_s = answers.wait_s()
            if wait_s is not None and wait_s <= 0:
                return
            watched = {}
            for rank in answers.pending:
                watched[self._pipes[rank].conn] = rank
                watched[self._procs[rank].sentinel] = rank
            for ready in wait(list(watched), wait_s):
                self._take(watched[ready], answers)

    def _take(self, rank: int, answers: Answers) -> None:
        if rank not in answers.pending:
            return  # both its pipe and its sentinel were ready
        try:
            if self._pipes[rank].conn.poll():
                answers.inbox[rank] = self._read(rank, answers.call)
                answers.drain()
                return
        except (EOFError, OSError):
            pass
        proc = self._procs[rank]
        proc.join(5)
        if proc.exitcode is None:
            answers.died(rank, f"its pipe failed while its process (pid {proc.pid}) is alive")
        else:
            answers.died(rank, f"its process (pid {proc.pid}) died, exit code {proc.exitcode}")

    def _read(self, rank: int, call: str) -> bytes:
        """One answer off rank's pipe. Interrupted part-way, the pipe is out of step (the rest
        of that answer would be read as the next): the group is broken, and says why."""
        pipe = self._pipes[rank]
        try:
            return pipe.receive(call)
        except (EOFError, OSError):
            raise
        except BaseException:
            self.broken = WorkerError(rank, call, f"the driver was {pipe.torn}", broken=True)
            raise

    def shutdown(self) -> None:
        """Ask every process to stop; kill what is still alive after a few seconds."""
        for pipe, proc in zip(self._pipes, self._procs, strict=True):
            if proc.is_alive() and self.broken is None:
                pipe.ask_to_close()
        for proc in self._procs:
            proc.join(10 if self.broken is None else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in self._pipes:
            pipe.conn.close()


def local_envs(world_size: int, extra: dict[str, str]) -> list[dict[str, str]]:
    """torchrun's variables per rank (MASTER_* are added at launch); LOCAL_RANK picks the GPU."""
    threads = str(max(1, (os.cpu_count() or 1) // world_size))
    return [
        {
            "RANK": str(r),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": threads,
            **extra,
        }
        for r in range(world_size)
    ]
