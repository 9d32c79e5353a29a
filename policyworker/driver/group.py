"""What both backends of the driver share: the error a failed call raises and the rules that
turn each rank's answer (or silence) into one outcome.

Every request carries a call id that its answer echoes; an answer with another id (left over
from an earlier call) is dropped, never taken for this call's. A call the driver itself leaves
early (an exception between sending and the last answer: Ctrl-C, a failing callback) is settled
by the next call before it sends anything: it waits for the old call's answers under the rules
below, so every rank is back in step (or the group is broken) before new work starts. A driver
interrupted while still sending a call breaks the group: some ranks may run it alone.

A call fails when a rank raises or its process dies. A rank's exception reaches the caller as
itself — its type (a `ValueError`, `CheckpointError`, `RefitError`, ...) and message — with the
rank, the call and the remote traceback in a `WorkerError` as its cause; `WorkerError` itself is
what a dead or hung rank gives (and an exception that does not survive pickling). Then:
- a dead rank fails the call at once (its peers may wait in a collective forever), and the group
  is broken: every later call raises until `shutdown()`;
- a rank that raised gives the others `failure_timeout_s` to answer; if they all do, the group
  stays usable (e.g. every rank refused the same bad argument); if some do not (they wait in a
  collective for the failed one), the group is broken.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from traceback import format_exc
from typing import Any, Protocol

from policyworker.rpc import Failure, Reply
from policyworker.wire import unpack

log = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 1800.0
"""How long the next call waits for an interrupted call's answers when no `call_timeout_s`
bounds calls; then the group is broken (every wait has a bound)."""


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
    broken: WorkerError | None
    """The failure that broke the group (every later call raises it), or None."""
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
    call_id: int
    world_size: int
    failure_timeout_s: float
    call_timeout_s: float | None
    handles: dict[Any, int] = field(default_factory=dict)
    """The backend's pending handles of this call and their ranks (Ray: object refs)."""
    started: float = field(default_factory=time.monotonic)
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, Failure] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    first_error_at: float | None = None
    inbox: dict[int, bytes] = field(default_factory=dict)
    """Answers read off a channel and not yet taken in (`drain`): kept from the moment they
    are read, so that an interrupt while one is taken in loses nothing."""

    @property
    def pending(self) -> list[int]:
        done = self.values.keys() | self.errors.keys() | self.dead.keys()
        return [r for r in range(self.world_size) if r not in done]

    def add(self, rank: int, reply: Reply) -> None:
        if reply.id != self.call_id:  # an earlier call's: never this one's answer
            log.warning("rank %d: dropped an answer to call %d", rank, reply.id)
            return
        if isinstance(reply.value, Failure):
            self._failed(rank, reply.value)
            return
        try:
            self.values[rank] = unpack(reply.value)
            self.seconds[rank] = reply.seconds
        except Exception:  # e.g. a result of a class the driver cannot import
            self._failed(
                rank, Failure(f"its result does not unpickle in the driver:\n{format_exc()}")
            )

    def _failed(self, rank: int, failure: Failure) -> None:
        self.errors[rank] = failure
        self.first_error_at = self.first_error_at or time.monotonic()

    def drain(self) -> None:
        """Take in the answers read so far (again, after an interrupt: `add` is idempotent)."""
        for rank in list(self.inbox):
            self.add(rank, Reply.read(self.inbox[rank]))
            del self.inbox[rank]

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
            failure = self.errors[rank]
            if hung:  # the group is broken: that is the news, not the rank's own error
                late = f"ranks {hung} did not answer within {self.failure_timeout_s} s"
                error = WorkerError(rank, self.call, f"{failure.traceback}\n{late}", broken=True)
                raise error from failure.exception()
            error = WorkerError(rank, self.call, failure.traceback, broken=False)
            failure.raise_as(error, f"rank {rank} in {self.call}")
        if hung:
            raise WorkerError(
                hung[0], self.call, f"no answer within {self.call_timeout_s} s", broken=True
            )
        return [self.values[r] for r in range(self.world_size)]


class GroupState(abc.ABC):
    """What both backends keep between calls, and how a call's answers settle into it.

    A backend implements `_send` (one rank's request) and `_collect` (wait for answers until
    `answers.done()` or its time is up); `_call` runs them with the interruption rules."""

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
        self._last_id = 0
        self._unsettled: Answers | None = None
        """A call the driver left before every answer came: the next call settles it first."""

    @abc.abstractmethod
    def _send(self, rank: int, answers: Answers, request: Any) -> None: ...

    @abc.abstractmethod
    def _collect(self, answers: Answers) -> None: ...

    def _answers(self, call: str, timeout_s: float | None, *, check: bool = True) -> Answers:
        if check and self.broken is not None:
            raise self.broken
        if self._unsettled is not None:
            self._settle_interrupted(self._unsettled)
        self._last_id += 1
        return Answers(call, self._last_id, self.world_size, self.failure_timeout_s, timeout_s)

    def _call(self, answers: Answers, requests: Sequence[Any]) -> list[Any]:
        """Send rank r `requests[r]`, wait for the answers and settle them."""
        for rank, request in enumerate(requests):
            try:
                self._send(rank, answers, request)
            except BaseException as e:
                self.broken = WorkerError(
                    rank,
                    answers.call,
                    f"the driver was interrupted while sending the call ({e!r}); ranks before "
                    f"{rank} may run it without the others",
                    broken=True,
                )
                raise
        try:
            self._collect(answers)
        except BaseException:
            self._unsettled = answers
            raise
        return self._settle(answers)

    def _settle_interrupted(self, answers: Answers) -> None:
        """Wait for the answers of a call the driver left early; drop them (they were the old
        call's), or break the group if its ranks fell out of step or do not answer in time."""
        if answers.call_timeout_s is None:  # bounded from now: the old call may still run
            answers.call_timeout_s = time.monotonic() - answers.started + SETTLE_TIMEOUT_S
        log.warning(
            "waiting for the interrupted call %s to end on the workers (at most %.0f s)",
            answers.call,
            answers.started + answers.call_timeout_s - time.monotonic(),
        )
        self._collect(answers)  # interrupted again: it stays unsettled for the next call
        self._unsettled = None
        try:
            self._settle(answers)
        except Exception as e:
            if self.broken is not None:
                raise
            log.warning("the interrupted call %s failed after all: %s", answers.call, e)
        log.warning("dropped the answers of the interrupted call %s", answers.call)

    def _settle(self, answers: Answers) -> list[Any]:
        self.last_worker_s = max(answers.seconds.values(), default=0.0)
        try:
            return answers.result()
        except WorkerError as e:
            if e.broken:
                self.broken = e
            raise
