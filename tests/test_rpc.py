"""The one request/reply layer of every process we start (`policyworker.rpc`), with a thread as
the child: ids, late replies dropped, typed failures, notices, torn pipes, a clean close."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch

from policyworker import rpc
from policyworker.refit.layout import RefitError
from policyworker.wire import unpack


class _Handler:
    def __init__(self) -> None:
        self.noticed: list[Any] = []

    def __call__(self, kind: str, payload: Any) -> Any:
        if kind == "echo":
            return payload
        if kind == "sleep":
            time.sleep(payload)
            return payload
        if kind == "refit":
            raise RefitError(f"refused {payload}")
        if kind == "notice":
            self.noticed.append(payload)
            return None
        raise KeyError(kind)


@pytest.fixture
def pair():
    parent, child = mp.Pipe()
    handler = _Handler()
    closed: list[bool] = []
    thread = threading.Thread(target=lambda: closed.append(rpc.serve(child, handler)))
    thread.start()
    pipe = rpc.Pipe(parent)
    yield pipe, handler, closed
    pipe.ask_to_close()
    thread.join(5)
    assert not thread.is_alive()
    parent.close()
    child.close()


def _value(reply: rpc.Reply) -> Any:
    assert not isinstance(reply.value, rpc.Failure), reply.value
    return unpack(reply.value)


def test_a_reply_echoes_its_request_and_tensors_come_by_value(pair):
    pipe, _, _ = pair
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    pipe.send(rpc.request(7, "echo", {"t": t}), "echo")
    reply = pipe.wait(7, 5.0, "echo")
    assert reply.id == 7 and reply.seconds >= 0
    assert torch.equal(_value(reply)["t"], t)


def test_a_late_reply_is_dropped_by_id_and_the_next_request_gets_its_own(pair):
    pipe, _, _ = pair
    pipe.send(rpc.request(1, "sleep", 0.3), "sleep")
    with pytest.raises(rpc.PipeError, match=r"no answer to sleep in 0\.05 s"):
        pipe.wait(1, 0.05, "sleep")
    pipe.send(rpc.request(2, "echo", "mine"), "echo")
    assert _value(pipe.wait(2, 5.0, "echo")) == "mine"  # not the sleep's 0.3


def test_a_failure_is_raised_as_the_handlers_own_type_with_its_traceback(pair):
    pipe, _, _ = pair
    pipe.send(rpc.request(3, "refit", "v2"), "refit")
    failure = pipe.wait(3, 5.0, "refit").value
    assert isinstance(failure, rpc.Failure) and "RefitError: refused v2" in failure.traceback
    with pytest.raises(RefitError) as e:
        failure.raise_as(RuntimeError("ours"), "the child in refit")
    assert str(e.value) == "refused v2" and str(e.value.__cause__) == "ours"
    assert "raised by the child in refit" in e.value.__notes__[0]
    pipe.send(rpc.request(4, "unknown", None), "unknown")  # the child stays up for the next
    assert isinstance(pipe.wait(4, 5.0, "unknown").value, rpc.Failure)
    pipe.send(rpc.request(5, "echo", 5), "echo")
    assert _value(pipe.wait(5, 5.0, "echo")) == 5


def test_arguments_the_child_cannot_unpickle_are_that_requests_error(pair):
    pipe, _, _ = pair
    header, _ = rpc.request(6, "echo", None)
    pipe.send((header, b"\x80\x05not a pickle"), "echo")
    failure = pipe.wait(6, 5.0, "echo").value
    assert isinstance(failure, rpc.Failure) and failure.pickled is None
    assert "arguments do not unpickle here" in failure.traceback
    with pytest.raises(RuntimeError, match="ours"):  # text only: the parent's own error
        failure.raise_as(RuntimeError("ours"), "the child")


def test_a_notice_gets_no_reply(pair):
    pipe, handler, _ = pair
    pipe.send(rpc.request(rpc.NOTICE, "notice", "hello"), "notice")
    pipe.send(rpc.request(8, "echo", 8), "echo")
    assert pipe.wait(8, 5.0, "echo").id == 8  # the first reply on the pipe is the echo's
    assert handler.noticed == ["hello"]


def test_an_interrupt_while_reading_tears_the_pipe_and_every_later_use_says_so(pair):
    pipe, _, _ = pair
    real = pipe.conn.recv_bytes

    def interrupted() -> bytes:
        pipe.conn.recv_bytes = real  # type: ignore[method-assign]
        raise KeyboardInterrupt

    pipe.conn.recv_bytes = interrupted  # type: ignore[method-assign]
    pipe.send(rpc.request(9, "echo", 9), "echo")
    with pytest.raises(KeyboardInterrupt):
        pipe.wait(9, 5.0, "echo")
    assert "interrupted while reading the answer to echo" in (pipe.torn or "")
    start = time.monotonic()
    with pytest.raises(rpc.PipeError, match=r"echo: interrupted while reading .* out of step"):
        pipe.send(rpc.request(10, "echo", 10), "echo")
    assert time.monotonic() - start < 0.1
    pipe.torn = None  # let the fixture close the child: the test is over


def test_close_ends_serve_and_a_parent_gone_ends_it_too(pair):
    pipe, _, closed = pair
    pipe.ask_to_close()
    for _ in range(100):
        if closed:
            break
        time.sleep(0.01)
    assert closed == [True]
    parent, child = mp.Pipe()
    parent.close()
    assert rpc.serve(child, _Handler()) is False


def test_ready_tells_the_parent_that_the_child_started_or_why_not():
    parent, child = mp.Pipe()
    assert rpc.ready(child, lambda: "engine") == "engine"
    assert unpack(rpc.Pipe(parent).wait(rpc.NOTICE, 1.0, "start").value) is None

    def broken() -> None:
        raise FileNotFoundError("no model here")

    assert rpc.ready(child, broken) is None
    failure = rpc.Pipe(parent).wait(rpc.NOTICE, 1.0, "start").value
    assert isinstance(failure, rpc.Failure)
    with pytest.raises(FileNotFoundError, match="no model here"):
        failure.raise_as(RuntimeError("start"), "the child")
