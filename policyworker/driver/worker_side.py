"""What runs inside each worker process of a driver's group (a spawned process or a Ray actor).

The host sets the rank's torchrun-style environment, builds one `MegatronPolicyWorker` and runs
the calls the driver sends. Every request carries the driver's call id and every answer echoes
it — `(call_id, "ok", value, seconds)` or `(call_id, "error", traceback, 0.0)` — so the driver
never takes an answer for another request's. A worker's exception travels back as text, so the
driver can name the rank and the call, and the process stays up for the next call.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from policyworker.compat.process import exit_now
from policyworker.logs import quiet_third_party
from policyworker.wire import pack

Answer = tuple[int, str, Any, float]
"""(call id, "ok" | "error", the value `wire.pack`ed or a `Failure`, seconds the call ran here)."""

Failure = tuple[str, bytes | None]
"""A call's failure: the remote traceback, and the exception pickled (None if it does not
pickle), so that the driver can raise the worker's own exception type."""


def failure(error: BaseException | None = None, text: str | None = None) -> Failure:
    """The failure being handled (or `text` alone, for one that is no exception here)."""
    blob = None
    if error is not None and isinstance(error, Exception):
        try:
            blob = pickle.dumps(error, protocol=5)
        except Exception:
            blob = None
    return text if text is not None else traceback.format_exc(), blob


class WorkerHost:
    """One rank: its environment, its worker, and the calls run on it."""

    def __init__(self, env: dict[str, str], log_levels: dict[str, int] | None = None) -> None:
        os.environ.update(env)
        quiet_third_party()
        threads = int(env.get("OMP_NUM_THREADS", "0"))
        if threads:
            torch.set_num_threads(threads)
        _configure_logging(int(env.get("RANK", "0")), log_levels or {})
        self.worker: Any = None

    def start(
        self, call_id: int, kwargs: dict[str, Any], env: dict[str, str] | None = None
    ) -> Answer:
        """Build the worker (collective: every rank of the group starts it at once); answers
        this process's pid."""
        from policyworker.worker import MegatronPolicyWorker

        os.environ.update(env or {})
        try:
            self.worker = MegatronPolicyWorker(**kwargs)
        except BaseException as e:
            return call_id, "error", failure(e), 0.0
        return call_id, "ok", pack(os.getpid()), 0.0

    def execute(self, call_id: int, call: str, kwargs: dict[str, Any]) -> Answer:
        """Run the worker's method `call` (a name from the driver's table of calls)."""
        if self.worker is None:
            return call_id, "error", failure(text="the worker was not started"), 0.0
        start = time.perf_counter()
        try:
            value = pack(getattr(self.worker, call)(**kwargs))
        except BaseException as e:
            return call_id, "error", failure(e), 0.0
        return call_id, "ok", value, time.perf_counter() - start

    def close(self) -> None:
        """Shut the worker down (a pending async save is committed), leave the process groups."""
        from policyworker.parallel.dims import destroy_parallel

        if self.worker is not None:
            self.worker.shutdown()
        destroy_parallel()


def serve(conn: Connection, env: dict[str, str], log_levels: dict[str, int]) -> None:
    """A local worker process: answer requests until "close" or EOF.

    A request is two frames: the header `(call_id, kind)`, then the pickled payload. A payload
    this process cannot unpickle (a class it cannot import) is answered as an error of that
    call, so the driver names it and the process stays in step."""
    host = WorkerHost(env, log_levels)
    while True:
        try:
            call_id, kind = pickle.loads(conn.recv_bytes())
            payload_bytes = conn.recv_bytes()
        except EOFError:  # the driver went away
            return
        if kind == "close":
            host.close()
            exit_now()  # done and committed: skip the interpreter's second of teardown
        try:
            payload = pickle.loads(payload_bytes)
        except BaseException:
            answer: Answer = (call_id, "error", failure(text=_unpickle_error()), 0.0)
        else:
            answer = (
                host.start(call_id, payload) if kind == "start" else host.execute(call_id, *payload)
            )
        conn.send_bytes(pickle.dumps(answer, protocol=5))


def _unpickle_error() -> str:
    return "the request's arguments do not unpickle in the worker:\n" + traceback.format_exc()


def _configure_logging(rank: int, levels: dict[str, int]) -> None:
    logging.basicConfig(
        level=levels.get("", logging.WARNING),
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
    for name, level in levels.items():
        logging.getLogger(name or None).setLevel(level)
    logging.getLogger("megatron").setLevel(max(logging.WARNING, levels.get("", 0)))
