"""An `HFEngine` in its own process, refitted over IPC like a colocated vLLM/SGLang worker.

    gen = GenerationProcess(model_dir, worker.prepare_refit_info(), tokenizer=tok)
    gen.begin_refit_ipc(worker.get_zmq_address())   # the engine starts receiving
    worker.stream_weights_via_ipc_zmq()             # the trainer streams
    version = gen.end_refit()                       # the engine's verdict: the version it applied
    samples = gen.sample(prompts, n=8, max_new_tokens=16, temperature=1.0, seed=0)

Commands travel over a pipe, each with an id that its answer echoes; each has a deadline, and a
dead process is an error, not a hang. A command that timed out is still answered later: that
answer is dropped by id, so the next command gets its own (the engine stays usable). Messages
are plain pickles, tensors by value (no file descriptors passed for storages: an interrupted
rebuild of one blocked the next command); an interrupt part-way through sending or reading one
leaves the pipe out of step, and every later command says so at once (`close()` and start a
new process).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from policyworker.compat.process import exit_now
from policyworker.generation.engine import Samples
from policyworker.refit.buffers import remove_leftovers
from policyworker.refit.layout import RefitError, RefitInfo
from policyworker.wire import pack, unpack

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # importing torch and transformers, loading the model


def tensor_sums(t: torch.Tensor) -> tuple[float, float]:
    """Sum and sum of squares in float64, on the CPU: the same bits give the same two numbers
    wherever the tensor lives (a GPU reduces in another order than the CPU)."""
    d = t.detach().to("cpu", torch.float64)
    return float(d.sum()), float(d.square().sum())


class EngineError(RuntimeError):
    """The generation process failed a command (its traceback is in the message) or died."""


class GenerationProcess:
    """The parent's handle on a generation process."""

    def __init__(
        self,
        model_dir: str,
        info: RefitInfo,
        *,
        tokenizer: Any = None,
        device: str = "cpu",
        timeout_s: float = 120.0,
        load_weights: bool = True,
        shared_staging: bool = True,
    ) -> None:
        """`shared_staging`: IPC refits write straight into the engine's staging area (one pass
        over the bytes); False: through the trainer's two buffers (docs/refit.md)."""
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(child, model_dir, info, tokenizer, device, load_weights, shared_staging),
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._ids = itertools.count(1)
        self._refit: int | None = None  # the id of the refit begun and not yet ended
        self._torn: str | None = None  # why the pipe is out of step (an interrupt), if it is
        self._wait(0, _START_TIMEOUT_S, "start")

    def begin_refit_ipc(self, address: str, timeout_s: float | None = None) -> None:
        """Start receiving a refit from the trainer bound at `address`; returns at once."""
        self._begin_refit("refit_ipc", (address, timeout_s or self.timeout_s))

    def init_collective(self, host: str, port: int, world_size: int, rank: int) -> None:
        """Join the trainer's collective refit group as `rank`; returns at once (the group forms
        when the trainer joins; a failure is raised by the next call)."""
        self._send("init_collective", (host, port, world_size, rank, self.timeout_s))

    def begin_refit_collective(self, timeout_s: float | None = None) -> None:
        """Start receiving a collective refit (`update_weights_from_collective`); returns at once."""
        self._begin_refit("refit_collective", (timeout_s or self.timeout_s,))

    def bind_sparse(self, *, api_key: str, host: str = "127.0.0.1") -> str:
        """Open the engine's sparse-refit receiver (TCP) for messages signed with `api_key`
        (the run's key, shared with the trainers); its address, for the trainers. Binding
        again with the same settings gives the same address; other settings are refused."""
        return self._call("bind_sparse", (), {"api_key": api_key, "host": host})

    def begin_refit_sparse(
        self,
        transfer_id: str,
        producers: int,
        timeout_s: float | None = None,
        *,
        tree: list[str] | None = None,
    ) -> None:
        """Start receiving sparse transfer `transfer_id` from `producers` trainer ranks;
        `tree`: every engine's address as the trainers get them (this engine relays to its
        children there; None: it receives alone)."""
        args = (transfer_id, producers, timeout_s or self.timeout_s, tree)
        self._begin_refit("refit_sparse", args)

    def end_refit(self) -> int:
        """The version the engine applied; `RefitError` if the refit failed (weights unchanged)."""
        if self._refit is None:
            raise EngineError("end_refit: no refit was begun")
        refit, self._refit = self._refit, None
        return self._wait(refit, self.timeout_s * 2, "refit")

    def sample(
        self,
        prompts: list[str],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> Samples:
        """`n` responses per prompt with their generation logprobs (`HFEngine.sample` says which
        distribution they are of under top-k / top-p); `seed` makes the draw reproducible."""
        checks = (
            ("n", isinstance(n, int) and n >= 1, "an int >= 1", n),
            ("max_new_tokens", isinstance(max_new_tokens, int) and max_new_tokens >= 1, "an int >= 1", max_new_tokens),
            ("temperature", isinstance(temperature, int | float) and 0 < temperature < float("inf"), "a finite number > 0", temperature),
            ("top_k", isinstance(top_k, int) and top_k >= 0, "an int >= 0 (0: off)", top_k),
            ("top_p", isinstance(top_p, int | float) and 0 < top_p <= 1, "a number in (0, 1]", top_p),
        )  # fmt: skip
        for name, ok, expected, value in checks:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {value!r}")
        kwargs = dict(
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            top_k=top_k,
            top_p=top_p,
        )
        return self._call("sample", (prompts,), kwargs)

    def logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._call("logprobs", (input_ids, lengths), {})

    def weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the engine's refitted tensors (for checks)."""
        return self._call("weights", (), {})

    def weight_sums(self) -> dict[str, tuple[float, float]]:
        """Per tensor, the float64 sum and sum of squares, computed where the weights live (a
        cheap check of a large model, where `weights()` would copy it through the pipe)."""
        return self._call("weight_sums", (), {})

    def version(self) -> int | None:
        return self._call("version", (), {})

    def close(self) -> None:
        if self._proc.is_alive() and self._torn is None:  # an out-of-step pipe: killed below
            with contextlib.suppress(BrokenPipeError, OSError):
                self._send("close", ())
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        remove_leftovers(self._proc.pid)

    def __enter__(self) -> GenerationProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _begin_refit(self, name: str, payload: tuple) -> None:
        if self._refit is not None:
            raise EngineError(f"{name}: a refit is in progress; end_refit() first")
        self._refit = self._send(name, payload)

    def _call(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if self._refit is not None:
            raise EngineError(f"{name}: a refit is in progress; end_refit() first")
        return self._wait(self._send(name, (args, kwargs)), self.timeout_s, name)

    def _send(self, name: str, payload: tuple) -> int:
        if self._torn is not None:
            raise EngineError(f"{name}: {self._torn}; close() this process and start another")
        command = next(self._ids)
        message = pack((command, name, payload))
        with self._whole(f"sending {name}"):
            self._conn.send_bytes(message)
        return command

    @contextlib.contextmanager
    def _whole(self, what: str) -> Iterator[None]:
        """A message moved whole over the pipe, or the pipe marked out of step."""
        try:
            yield
        except (EOFError, OSError):
            raise
        except BaseException as e:
            self._torn = f"the pipe is out of step: interrupted while {what} ({e!r})"
            raise

    def _wait(self, command: int, timeout_s: float, what: str) -> Any:
        """The answer to `command`; answers to earlier commands that timed out are dropped."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                alive = "is alive" if self._proc.is_alive() else "has died"
                raise EngineError(
                    f"generation process: no answer to {what} in {timeout_s} s ({alive})"
                )
            try:
                with self._whole(f"reading the answer to {what}"):
                    raw = self._conn.recv_bytes()
                answered, status, value = unpack(raw)
            except EOFError:
                raise EngineError(f"generation process died during {what}") from None
            if answered == command:
                break
            log.warning("generation process: dropped the late answer to command %d", answered)
        if status == "refit_error":
            raise RefitError(value)
        if status == "error":
            raise EngineError(f"generation process failed {what}:\n{value}")
        return value


class _SparseSide:
    """The engine's sparse-refit receiver, opened by the first `bind_sparse` (one per engine:
    binding again with the same key and host gives its address, other settings are refused)."""

    def __init__(self, targets: dict[str, torch.Tensor], info: RefitInfo) -> None:
        self.targets, self.info = targets, info
        self.receiver: Any = None

    def bind(self, api_key: str, host: str) -> str:
        from policyworker.refit.sparse_link import key_bytes
        from policyworker.refit.sparse_receiver import SparseReceiver

        if self.receiver is None:
            self.receiver = SparseReceiver(self.targets, self.info, api_key=api_key, host=host)
        elif (key_bytes(api_key), host) != (self.receiver.key, self.receiver.host):
            raise ValueError(
                "bind_sparse: bound already with another key or host; one receiver per engine"
            )
        return self.receiver.address

    def receive(
        self, transfer_id: str, producers: int, timeout_s: float, tree: list[str] | None
    ) -> int:
        if self.receiver is None:
            raise RuntimeError("refit_sparse: bind_sparse() first")
        return self.receiver.receive(transfer_id, producers, timeout_s, tree=tree)


def _serve(
    conn: Connection,
    model_dir: str,
    info: RefitInfo,
    tokenizer: Any,
    device: str,
    load_weights: bool,
    shared_staging: bool,
) -> None:
    """The process: build the engine and its staging area, then answer commands until close."""
    from policyworker.generation.engine import HFEngine
    from policyworker.refit.ipc import receive_ipc
    from policyworker.refit.receiver import Staging

    # the model's dtype: that of its weights (not of MXFP8 values or scales)
    dtypes = {dtype for _, dtype in info.values() if dtype.is_floating_point and dtype.itemsize > 1}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    engine = HFEngine(
        model_dir, tokenizer, device=torch.device(device), dtype=dtype, load_weights=load_weights
    )
    targets = engine.refit_targets(info)
    staging = Staging(info, targets, adopt=True, shared=shared_staging)  # adopt: no CUDA graphs
    conn.send_bytes(pack((0, "ok", None)))
    collective = _Collective(engine.device)

    def loaded(version: int) -> int:
        engine.load_mxfp8(staging.targets)  # MXFP8 slots dequantized into the model
        return version

    sparse = _SparseSide(targets, info)
    handlers: dict[str, Callable[..., Any]] = {  # each command's payload, as its arguments
        "sample": lambda args, kw: engine.sample(*args, **kw),
        "logprobs": lambda args, kw: engine.logprobs(*args, **kw),
        "weights": lambda args, kw: {
            n: t.detach().cpu().clone() for n, t in staging.targets.items()
        },
        "weight_sums": lambda args, kw: {n: tensor_sums(t) for n, t in staging.targets.items()},
        "version": lambda args, kw: staging.version,
        "bind_sparse": lambda args, kw: sparse.bind(**kw),
        "refit_sparse": sparse.receive,
        "refit_ipc": lambda address, timeout_s: loaded(
            receive_ipc(staging, address=address, timeout_s=timeout_s)
        ),
        "refit_collective": lambda timeout_s: loaded(collective.receive(staging, timeout_s)),
    }
    while True:
        command, name, payload = unpack(conn.recv_bytes())
        if name == "close":
            exit_now()  # nothing left to do: skip the interpreter's second of teardown
        if name == "init_collective":  # no answer: the trainer joins after us
            collective.join(*payload)
            continue
        try:
            collective.check()
            answer = (command, "ok", handlers[name](*payload))
        except RefitError as e:
            answer = (command, "refit_error", str(e))
        except Exception:
            answer = (command, "error", traceback.format_exc())
        conn.send_bytes(pack(answer))  # tensors by value


class _Collective:
    """The engine's collective refit group. Joined without an answer (the group forms when the
    trainer joins, after us); a failure to join is raised by every later command."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.group: Any = None
        self.error: str | None = None

    def join(self, host: str, port: int, world_size: int, rank: int, timeout_s: float) -> None:
        from policyworker.refit.group import join_refit_group

        try:
            self.group = join_refit_group(
                host, port, world_size, rank, device=self.device, timeout_s=timeout_s
            )
        except Exception:
            self.error = traceback.format_exc()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"joining the refit group failed:\n{self.error}")

    def receive(self, staging: Any, timeout_s: float) -> int:
        from policyworker.refit.collective import receive_refit

        if self.group is None:
            raise RuntimeError("refit_collective: init_collective() first")
        return receive_refit(self.group, staging, device=self.device, timeout_s=timeout_s)
