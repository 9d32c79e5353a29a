"""An `HFEngine` in its own process, refitted over IPC like a colocated vLLM/SGLang worker.

    gen = GenerationProcess(model_dir, worker.prepare_refit_info(), tokenizer=tok)
    gen.begin_refit_ipc(worker.get_zmq_address())   # the engine starts receiving
    worker.stream_weights_via_ipc_zmq()             # the trainer streams
    version = gen.end_refit()                       # the engine's verdict: the version it applied
    samples = gen.sample(prompts, n=8, max_new_tokens=16, temperature=1.0, seed=0)

Commands are `rpc` requests over a pipe: each has a deadline, and a dead process is an error,
not a hang. A command that timed out is still answered later: that answer is dropped by id, so
the next command gets its own (the engine stays usable). Tensors travel by value (no file
descriptors passed for storages: an interrupted rebuild of one blocked the next command); an
interrupt part-way through sending or reading a message leaves the pipe out of step, and every
later command says so at once (`close()` and start a new process). The engine's exception is
raised as itself (a `RefitError`, a `ValueError`, ...) with an `EngineError` as its cause.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from policyworker import rpc
from policyworker.compat.process import exit_now
from policyworker.generation.engine import Samples
from policyworker.refit.buffers import remove_leftovers
from policyworker.refit.layout import RefitInfo
from policyworker.wire import unpack

_START_TIMEOUT_S = 300.0  # importing torch and transformers, loading the model


def tensor_sums(t: torch.Tensor) -> tuple[float, float]:
    """Sum and sum of squares in float64, on the CPU: the same bits give the same two numbers
    wherever the tensor lives (a GPU reduces in another order than the CPU)."""
    d = t.detach().to("cpu", torch.float64)
    return float(d.sum()), float(d.square().sum())


class EngineError(RuntimeError):
    """The generation process did not answer a command (no answer in time, it died, the pipe is
    out of step), or, as the cause of the engine's own exception, its traceback."""


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
        conn, child = ctx.Pipe()
        self._pipe = rpc.Pipe(conn)
        self._proc = ctx.Process(
            target=_serve,
            args=(child, model_dir, info, tokenizer, device, load_weights, shared_staging),
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._ids = itertools.count(1)
        self._refit: int | None = None  # the id of the refit begun and not yet ended
        self._wait(rpc.NOTICE, _START_TIMEOUT_S, "start")  # the process says it is ready

    def begin_refit_ipc(self, address: str, timeout_s: float | None = None) -> None:
        """Start receiving a refit from the trainer bound at `address`; returns at once."""
        self._begin_refit("refit_ipc", address, timeout_s or self.timeout_s)

    def init_collective(self, host: str, port: int, world_size: int, rank: int) -> None:
        """Join the trainer's collective refit group as `rank`; returns at once (the group forms
        when the trainer joins; a failure is raised by the next call)."""
        args = (host, port, world_size, rank, self.timeout_s)
        self._send("init_collective", (args, {}), notice=True)

    def begin_refit_collective(self, timeout_s: float | None = None) -> None:
        """Start receiving a collective refit (`update_weights_from_collective`); returns at once."""
        self._begin_refit("refit_collective", timeout_s or self.timeout_s)

    def bind_sparse(self, *, api_key: str, host: str = "127.0.0.1") -> str:
        """Open the engine's sparse-refit receiver (TCP) for messages signed with `api_key`
        (the run's key, shared with the trainers); its address, for the trainers. Binding
        again with the same settings gives the same address; other settings are refused."""
        return self._call("bind_sparse", api_key=api_key, host=host)

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
        self._begin_refit("refit_sparse", transfer_id, producers, timeout_s or self.timeout_s, tree)

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
        return self._call(
            "sample",
            prompts,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            top_k=top_k,
            top_p=top_p,
        )

    def logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self._call("logprobs", input_ids, lengths)

    def weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the engine's refitted tensors (for checks)."""
        return self._call("weights")

    def weight_sums(self) -> dict[str, tuple[float, float]]:
        """Per tensor, the float64 sum and sum of squares, computed where the weights live (a
        cheap check of a large model, where `weights()` would copy it through the pipe)."""
        return self._call("weight_sums")

    def version(self) -> int | None:
        return self._call("version")

    def close(self) -> None:
        if self._proc.is_alive() and self._pipe.torn is None:  # out of step: killed below
            self._pipe.ask_to_close()
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._pipe.conn.close()
        remove_leftovers(self._proc.pid)

    def __enter__(self) -> GenerationProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _begin_refit(self, name: str, *args: Any) -> None:
        if self._refit is not None:
            raise EngineError(f"{name}: a refit is in progress; end_refit() first")
        self._refit = self._send(name, (args, {}))

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._refit is not None:
            raise EngineError(f"{name}: a refit is in progress; end_refit() first")
        return self._wait(self._send(name, (args, kwargs)), self.timeout_s, name)

    def _send(self, name: str, payload: Any, *, notice: bool = False) -> int:
        command = rpc.NOTICE if notice else next(self._ids)
        try:
            self._pipe.send(rpc.request(command, name, payload), name)
        except rpc.PipeError as e:
            raise EngineError(f"{e}; close() this process and start another") from None
        return command

    def _wait(self, command: int, timeout_s: float, what: str) -> Any:
        """The answer to `command`, the engine's exception raised as itself."""
        try:
            reply = self._pipe.wait(command, timeout_s, what)
        except rpc.PipeError as e:
            alive = "is alive" if self._proc.is_alive() else "has died"
            raise EngineError(f"generation process: {e} (it {alive})") from None
        if isinstance(reply.value, rpc.Failure):
            error = EngineError(f"generation process failed {what}:\n{reply.value.traceback}")
            reply.value.raise_as(error, f"the generation process in {what}")
        return unpack(reply.value)


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


def _serve(conn: Connection, model_dir: str, info: RefitInfo, *options: Any) -> None:
    """The process: build the engine and its staging area, then answer commands until close."""
    engine = rpc.ready(conn, lambda: _Engine(model_dir, info, *options))
    if engine is not None and rpc.serve(conn, engine.handle):
        exit_now()  # nothing left to do: skip the interpreter's second of teardown


class _Engine:
    """The process's side: the engine, its staging area, its refit receivers, and a handler per
    command (its payload is the handler's arguments)."""

    def __init__(
        self,
        model_dir: str,
        info: RefitInfo,
        tokenizer: Any,
        device: str,
        load_weights: bool,
        shared_staging: bool,
    ) -> None:
        from policyworker.generation.engine import HFEngine
        from policyworker.refit.receiver import Staging

        # the model's dtype: that of its weights (not of MXFP8 values or scales)
        floats = {t for _, t in info.values() if t.is_floating_point and t.itemsize > 1}
        dtype = floats.pop() if len(floats) == 1 else torch.float32
        where = torch.device(device)
        self.engine = HFEngine(
            model_dir, tokenizer, device=where, dtype=dtype, load_weights=load_weights
        )
        targets = self.engine.refit_targets(info)
        # adopt: the engine's tensors are the targets (no CUDA graphs to keep pointers of)
        self.staging = Staging(info, targets, adopt=True, shared=shared_staging)
        self.collective = _Collective(self.engine.device)
        self.sparse = _SparseSide(targets, info)
        self.commands: dict[str, Callable[..., Any]] = {
            "sample": self.engine.sample,
            "logprobs": self.engine.logprobs,
            "weights": lambda: {n: t.detach().cpu().clone() for n, t in self.targets()},
            "weight_sums": lambda: {n: tensor_sums(t) for n, t in self.targets()},
            "version": lambda: self.staging.version,
            "bind_sparse": self.sparse.bind,
            "refit_sparse": self.sparse.receive,
            "refit_ipc": self.refit_ipc,
            "refit_collective": lambda timeout_s: self.loaded(
                self.collective.receive(self.staging, timeout_s)
            ),
        }

    def handle(self, kind: str, payload: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = payload
        if kind == "init_collective":  # a notice: the group forms when the trainer joins
            return self.collective.join(*args)
        self.collective.check()  # a failed join fails every later command
        return self.commands[kind](*args, **kwargs)

    def targets(self) -> Any:
        return self.staging.targets.items()

    def refit_ipc(self, address: str, timeout_s: float) -> int:
        from policyworker.refit.ipc import receive_ipc

        return self.loaded(receive_ipc(self.staging, address=address, timeout_s=timeout_s))

    def loaded(self, version: int) -> int:
        self.engine.load_mxfp8(self.staging.targets)  # MXFP8 slots dequantized into the model
        return version


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
