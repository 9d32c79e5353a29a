"""Requests and replies between a parent and a process it started — the driver and its worker
processes, a trainer and its generation process — written once for both.

A request is two frames: its header `(id, kind)`, then its payload (`wire.pack`ed: tensors by
value). A payload the child cannot unpickle (a class it cannot import) is that request's error,
and the pipe stays in step. A reply is one frame, a `Reply` that echoes the request's id: a parent
that stopped waiting for one (a deadline, a Ctrl-C) drops it by id when it comes later and never
takes it for another request's. A request with id `NOTICE` is not answered.

A message moves whole or the pipe is torn: interrupted part-way through sending or reading one,
the rest of it would be read as the next message, so `Pipe` refuses every later use at once and
says why (close that process and start another).

Failures are typed: a handler's exception travels pickled beside its traceback (`Failure`), and
the parent raises it as itself, the remote traceback in its cause, where it survives the trip.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, NoReturn

from policyworker.wire import pack, unpack

log = logging.getLogger(__name__)

NOTICE = 0
"""The id of a request that gets no reply."""
CLOSE = "close"
"""The kind of the notice that ends `serve`."""

Request = tuple[bytes, bytes]
"""A request's two frames: the header `(id, kind)` and the payload, pickled before any is sent."""


class PipeError(RuntimeError):
    """A request got no reply: none by its deadline, the child's end closed, or the pipe torn."""


@dataclass(frozen=True)
class Failure:
    """A request's failure: the remote traceback, and the exception pickled (None where it does
    not pickle, or where there was no exception but a message)."""

    traceback: str
    pickled: bytes | None = None

    @classmethod
    def caught(cls, error: BaseException) -> Failure:
        """The failure being handled, `error`."""
        blob = None
        if isinstance(error, Exception):  # a KeyboardInterrupt is not raised in the parent
            with contextlib.suppress(Exception):
                blob = pickle.dumps(error, protocol=5)
        return cls(traceback.format_exc(), blob)

    def exception(self) -> Exception | None:
        """The remote exception, where it unpickles here (its class may not import)."""
        if self.pickled is None:
            return None
        with contextlib.suppress(Exception):
            return pickle.loads(self.pickled)
        return None

    def raise_as(self, error: Exception, where: str) -> NoReturn:
        """Raise the remote exception as itself with `error` (ours, naming the request and
        carrying the traceback) as its cause; `error` alone where the exception did not come."""
        raised = self.exception()
        if raised is None:
            raise error
        raised.add_note(f"policyworker: raised by {where} (cause: its traceback)")
        raise raised from error


class Reply(NamedTuple):
    """A child's reply: the request's id, and the value `wire.pack`ed (unpickled by the parent,
    so a value it cannot unpickle is that request's error alone) or a `Failure`."""

    id: int
    value: bytes | Failure
    seconds: float
    """How long the handler ran in the child (the rest of a request's time is transport)."""

    @staticmethod
    def read(raw: bytes) -> Reply:
        return Reply(*pickle.loads(raw))


def request(request_id: int, kind: str, payload: Any) -> Request:
    """A request's frames; raises here, with nothing sent, if the payload does not pickle."""
    return pickle.dumps((request_id, kind)), pack(payload)


def answer(request_id: int, handler: Callable[..., Any], *args: Any) -> Reply:
    """`handler(*args)` run and its value or failure as the reply to `request_id`."""
    start = time.perf_counter()
    try:
        value = pack(handler(*args))
    except BaseException as e:  # the process stays up for the next request
        return Reply(request_id, Failure.caught(e), 0.0)
    return Reply(request_id, value, time.perf_counter() - start)


def serve(conn: Connection, handle: Callable[[str, Any], Any]) -> bool:
    """The child's loop: answer each request with `handle(kind, payload)` until a `CLOSE` notice
    (True) or until the parent's end is gone (False)."""
    while True:
        try:
            request_id, kind = pickle.loads(conn.recv_bytes())
            payload = conn.recv_bytes()
        except EOFError:
            return False
        if kind == CLOSE:
            return True
        try:
            args = unpack(payload)
        except Exception:  # text only: the parent raises its own error naming the request
            text = f"the request's arguments do not unpickle here:\n{traceback.format_exc()}"
            reply = Reply(request_id, Failure(text), 0.0)
        else:
            reply = answer(request_id, handle, kind, args)
        if request_id != NOTICE:
            conn.send_bytes(pickle.dumps(reply, protocol=5))


class Pipe:
    """The parent's end of one child's pipe: whole messages, or torn (`torn` says why)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.torn: str | None = None

    def send(self, frames: Request, what: str) -> None:
        if self.torn is not None:
            raise PipeError(f"{what}: {self.torn}")
        with self._whole(f"sending {what}"):
            for frame in frames:
                self.conn.send_bytes(frame)

    def receive(self, what: str) -> bytes:
        """One reply's bytes (`Reply.read` them)."""
        with self._whole(f"reading the answer to {what}"):
            return self.conn.recv_bytes()

    def wait(self, request_id: int, timeout_s: float, what: str) -> Reply:
        """The reply to `request_id` within `timeout_s`; replies to earlier requests that timed
        out come late and are dropped."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise PipeError(f"no answer to {what} in {timeout_s} s")
            try:
                reply = Reply.read(self.receive(what))
            except EOFError:
                raise PipeError(f"the process closed its pipe during {what}") from None
            if reply.id == request_id:
                return reply
            log.warning("dropped a late answer (to request %d, not %d)", reply.id, request_id)

    def ask_to_close(self) -> None:
        """Ask the child to end `serve` (not over a torn pipe; a child gone already is fine)."""
        if self.torn is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.send(request(NOTICE, CLOSE, None), CLOSE)

    @contextlib.contextmanager
    def _whole(self, what: str) -> Iterator[None]:
        try:
            yield
        except (EOFError, OSError):
            raise
        except BaseException as e:
            self.torn = f"interrupted while {what} ({e!r}): the pipe is out of step"
            raise


def ready[T](conn: Connection, build: Callable[[], T]) -> T | None:
    """A child's start: what `build()` makes, the parent told it is ready (the reply to
    `NOTICE`); None, the parent told why, if it raised."""
    try:
        built = build()
    except BaseException as e:
        conn.send_bytes(pickle.dumps(Reply(NOTICE, Failure.caught(e), 0.0)))
        return None
    conn.send_bytes(pickle.dumps(Reply(NOTICE, pack(None), 0.0)))
    return built
