"""What runs inside each worker process of a driver's group (a spawned process or a Ray actor).

The host sets the rank's torchrun-style environment, builds one `MegatronPolicyWorker` and runs
the calls the driver sends, as `rpc` requests: "start" (the worker's arguments), then each
call by its name (its keyword arguments). A worker's exception travels back typed (`rpc.Failure`),
so the driver raises it as itself and names the rank and the call, and the process stays up for
the next call.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection
from typing import Any

import torch

from policyworker import rpc
from policyworker.compat.process import exit_now
from policyworker.logs import quiet_third_party

START = "start"
"""The request that builds the worker (collective: every rank of the group starts it at once)."""


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

    def handle(self, kind: str, kwargs: dict[str, Any]) -> Any:
        """Run request `kind`: START builds the worker (answers this process's pid), any other
        is the worker's method of that name (a name from the driver's table of calls)."""
        if kind == START:
            from policyworker.worker import MegatronPolicyWorker

            self.worker = MegatronPolicyWorker(**kwargs)
            return os.getpid()
        if self.worker is None:
            raise RuntimeError("the worker was not started")
        return getattr(self.worker, kind)(**kwargs)

    def close(self) -> None:
        """Shut the worker down (a pending async save is committed), leave the process groups."""
        from policyworker.parallel.dims import destroy_parallel

        if self.worker is not None:
            self.worker.shutdown()
        destroy_parallel()


def serve(conn: Connection, env: dict[str, str], log_levels: dict[str, int]) -> None:
    """A local worker process: answer requests until the driver closes it or goes away."""
    host = WorkerHost(env, log_levels)
    if rpc.serve(conn, host.handle):
        host.close()
        exit_now()  # done and committed: skip the interpreter's second of teardown


def _configure_logging(rank: int, levels: dict[str, int]) -> None:
    logging.basicConfig(
        level=levels.get("", logging.WARNING),
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
    for name, level in levels.items():
        logging.getLogger(name or None).setLevel(level)
    logging.getLogger("megatron").setLevel(max(logging.WARNING, levels.get("", 0)))
