"""What both backends of the driver share: the error a failed call raises and the rules that
turn each rank's answer (or silence) into one outcome.

A call fails when a rank raises or its process dies. Then:
- a dead rank fails the call at once (its peers may wait in a collective forever), and the group
  is broken: every later call raises until `shutdown()`;
- a rank that raised gives the others `failure_timeout_s` to answer; if they all do, the group
  stays usable (e.g. every rank refused the same bad argument); if some do not (they wait in a
  collective for the failed one), the group is broken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol


class WorkerError(RuntimeError):
    """A call failed on a worker: `rank`, `call` and the remote traceback (or how it died)."""

    def __init__(self, rank: int, call: str, detail: str, *, broken: bool) -> None:
        state = "the group is broken: shutdown() it" if broken else "the group is usable"
        super().__init__(f"rank {rank} failed {call} ({state}):\n{detail}")
        self.rank = rank
        self.call = call
        self.detail = detail
        self.broken = broken


class WorkerGroup(Protocol):
    """A backend: `world_size` processes, each hosting one worker."""

    world_size: int
    pids: list[int]
    last_worker_s: float
    """How long the last call ran inside the slowest worker (the rest of its time is transport)."""

    def start(self, kwargs: dict[str, Any], timeout_s: float) -> None:
        """Build every rank's worker with `kwargs` (collective); fills `pids`."""
        ...

    def run(self, call: str, kwargs: list[dict[str, Any]]) -> list[Any]:
        """Run `call` on every rank (rank r with `kwargs[r]`); each rank's answer."""
        ...

    def shutdown(self) -> None: ...


@dataclass
class Answers:
    """The answers to one call as they come in, and what they mean."""

    call: str
    world_size: int
    failure_timeout_s: float
    call_timeout_s: float | None
    started: float = field(default_factory=time.monotonic)
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    first_error_at: float | None = None

    @property
    def pending(self) -> list[int]:
        done = self.values.keys() | self.errors.keys() | self.dead.keys()
        return [r for r in range(self.world_size) if r not in done]

    def add(self, rank: int, answer: tuple[Any, ...]) -> None:
        status, value, *timing = answer
        if status == "ok":
            self.values[rank] = value
            self.seconds[rank] = timing[0] if timing else 0.0
        else:
            self.errors[rank] = value
            self.first_error_at = self.first_error_at or time.monotonic()

    def died(self, rank: int, how: str) -> None:
        self.dead[rank] = how

    def done(self) -> bool:
        return not self.pending or bool(self.dead)

    def wait_s(self) -> float | None:
        """How long to wait for the next answer (None: no limit); <= 0 means stop waiting."""
        limits = []
        if self.first_error_at is not None:
            limits.append(self.first_error_at + self.failure_timeout_s)
        if self.call_timeout_s is not None:
            limits.append(self.started + self.call_timeout_s)
        return min(limits) - time.monotonic() if limits else None

    def result(self) -> list[Any]:
        """Every rank's value, or the `WorkerError` of the first failed rank."""
        if self.dead:
            rank = min(self.dead)
            raise WorkerError(rank, self.call, self.dead[rank], broken=True)
        hung = self.pending
        if self.errors:
            rank = min(self.errors)
            detail = self.errors[rank]
            if hung:
                detail += f"\nranks {hung} did not answer within {self.failure_timeout_s} s"
            raise WorkerError(rank, self.call, detail, broken=bool(hung))
        if hung:
            raise WorkerError(
                hung[0], self.call, f"no answer within {self.call_timeout_s} s", broken=True
            )
        return [self.values[r] for r in range(self.world_size)]


class GroupState:
    """What both backends keep between calls, and how a call's answers settle into it."""

    def __init__(
        self, world_size: int, failure_timeout_s: float, call_timeout_s: float | None
    ) -> None:
        self.world_size = world_size
        self.failure_timeout_s = failure_timeout_s
        self.call_timeout_s = call_timeout_s
        self.broken: WorkerError | None = None
        """The failure that broke the group: every later call raises it."""
        self.last_worker_s = 0.0
        self.pids: list[int] = []

    def _answers(self, call: str, timeout_s: float | None, *, check: bool = True) -> Answers:
        if check and self.broken is not None:
            raise self.broken
        return Answers(call, self.world_size, self.failure_timeout_s, timeout_s)

    def _settle(self, answers: Answers) -> list[Any]:
        self.last_worker_s = max(answers.seconds.values(), default=0.0)
        try:
            return answers.result()
        except WorkerError as e:
            if e.broken:
                self.broken = e
            raise
