"""The Ray backend: one Ray actor per rank, placed by a placement group that packs a node's ranks.

The driver joins the Ray cluster at `address` (or `RAY_ADDRESS`), or starts a local one when
none is given, and stops it again at shutdown if it started it. Each actor's resources and extra
environment come from `MegatronPolicyWorker.configure_worker(num_gpus, bundle_indices)`. A dead
actor surfaces as Ray's `RayActorError` on its pending call, which fails the call at once.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from policyworker import rpc
from policyworker.driver.group import Answers, GroupState
from policyworker.driver.worker_side import START, WorkerHost
from policyworker.parallel.dims import free_port

_PLACEMENT_TIMEOUT_S = 120.0
_CLOSE_TIMEOUT_S = 30.0


class RayHost(WorkerHost):
    """The worker host as a Ray actor: it also tells where rank 0 listens."""

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def environ(self, env: dict[str, str]) -> None:
        """Where rank 0 listens, known only once the actors run."""
        os.environ.update(env)

    def call(self, call_id: int, kind: str, kwargs: dict[str, Any]) -> rpc.Reply:
        return rpc.answer(call_id, self.handle, kind, kwargs)


class RayGroup(GroupState):
    """`world_size` Ray actors, each hosting one worker."""

    def __init__(
        self,
        world_size: int,
        *,
        envs: list[dict[str, str]],
        log_levels: dict[str, int],
        failure_timeout_s: float,
        call_timeout_s: float | None,
        address: str | None,
        configure: Any,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(world_size, failure_timeout_s, call_timeout_s)
        self._actors: list[Any] = []
        self._pg: Any = None
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            address = address or os.environ.get("RAY_ADDRESS")
            local = {"num_cpus": max(os.cpu_count() or 1, world_size)} if not address else {}
            ray.init(address=address, include_dashboard=False, **local)
        try:
            resources = ray.cluster_resources()
            gpus_per_worker = 1 if resources.get("GPU", 0) else 0  # one GPU per rank if any
            _check_resources(resources, world_size, gpus_per_worker)
            bundle = {"CPU": 1, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
            self._pg = placement_group([bundle] * world_size, strategy="PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(f"the Ray cluster cannot place {world_size} x {bundle}")
        except BaseException:
            self.shutdown()
            raise
        # Imports of the driver's modules (e.g. a loss class) must work in the actors too.
        path = os.pathsep.join(p for p in sys.path if p)
        self._init_kwargs: list[dict[str, Any]] = []
        for rank, env in enumerate(envs):
            resources, extra_env, init_kwargs = configure(gpus_per_worker, [rank])
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank
            )
            env = {**env, **_one_gpu(gpus_per_worker), **extra_env}
            actor = (
                ray.remote(RayHost)
                .options(
                    scheduling_strategy=strategy,
                    # present from the interpreter's start (OpenMP reads its threads then)
                    runtime_env={"env_vars": {**env, "PYTHONPATH": path}},
                    **resources,
                )
                .remote(env, log_levels)
            )
            self._actors.append(actor)
            self._init_kwargs.append(init_kwargs)
        host, port = ray.get(self._actors[0].address.remote())
        master = {"MASTER_ADDR": host, "MASTER_PORT": str(port)}
        ray.get([actor.environ.remote(master) for actor in self._actors])

    def start(self, kwargs: dict[str, Any], timeout_s: float) -> None:
        import ray

        answers = self._answers("start", timeout_s, check=False)
        requests = [(START, ray.put({**kwargs, **init})) for init in self._init_kwargs]
        self.pids = self._call(answers, requests)

    def run(self, call: str, kwargs: list[dict[str, Any]]) -> list[Any]:
        import ray

        answers = self._answers(call, self.call_timeout_s)
        # Every rank's arguments are serialized before any call is submitted: an argument that
        # does not serialize fails the call with nothing sent.
        return self._call(answers, [(call, ray.put(kw)) for kw in kwargs])

    def _send(self, rank: int, answers: Answers, request: tuple[str, Any]) -> None:
        ref = self._actors[rank].call.remote(answers.call_id, *request)
        answers.handles[ref] = rank

    def _collect(self, answers: Answers) -> None:
        import ray
        from ray.exceptions import RayActorError, RayError

        while not answers.done():
            wait_s = answers.wait_s()
            if wait_s is not None and wait_s <= 0:
                return
            ready, _ = ray.wait(list(answers.handles), num_returns=1, timeout=wait_s)
            for ref in ready:
                rank = answers.handles.pop(ref)
                try:
                    answers.add(rank, ray.get(ref))
                except RayActorError as e:  # the actor died (or Ray lost it)
                    answers.died(rank, f"{type(e).__name__}: {e}")
                except RayError as e:  # e.g. arguments the actor could not deserialize
                    text = f"{type(e).__name__}: {e}"
                    answers.add(rank, rpc.Reply(answers.call_id, rpc.Failure(text), 0.0))

    def shutdown(self) -> None:
        """Kill the actors, free the placement group; stop Ray if this driver started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.broken is None and self._actors:  # let each leave its process groups
            with contextlib.suppress(Exception):
                ray.get([a.close.remote() for a in self._actors], timeout=_CLOSE_TIMEOUT_S)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
        if self._started_ray:
            ray.shutdown()


def _one_gpu(gpus: int) -> dict[str, str]:
    """Ray shows an actor only its own GPU, which is then device 0."""
    return {"LOCAL_RANK": "0"} if gpus else {}


def _check_resources(resources: dict[str, float], world_size: int, gpus: int) -> None:
    if gpus and resources.get("GPU", 0) < world_size * gpus:
        raise ValueError(
            f"num_workers: {world_size} workers x {gpus} GPU need {world_size * gpus} GPUs; "
            f"the Ray cluster has {resources.get('GPU', 0):g}"
        )
