"""Refit peers for tests/test_refit.py that run in their own process (spawned). This module
imports no megatron, so a spawned peer starts in about a second."""

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from safetensors.torch import load_file

from policyworker.refit import ipc
from policyworker.refit.ipc import IpcLink, send_ipc
from policyworker.refit.layout import Layout


def kill(gen) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL a `GenerationProcess` (a receiver that dies mid-refit), and sweep what it left
    (as `close` does for a process that ends)."""
    from policyworker.refit.buffers import remove_leftovers

    gen._proc.kill()
    gen._proc.join()
    remove_leftovers(gen._proc.pid)


@contextlib.contextmanager
def tampering(tamper: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `tamper(bucket_bytes)` on every bucket an IPC refit of this process sends, right
    after its checksum was taken (corruption in transit); the refit must be checksummed."""
    real = ipc.checksum, ipc.checksum_on_device

    def after(fn: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], object]:
        def checked(data: torch.Tensor) -> object:
            total = fn(data)
            tamper(data)
            return total

        return checked

    ipc.checksum, ipc.checksum_on_device = after(real[0]), after(real[1])
    try:
        yield
    finally:
        ipc.checksum, ipc.checksum_on_device = real


def dying_trainer(model_dir: str, info, address: str, bucket_bytes: int, ready, go) -> None:
    """A sender that exits abruptly (no cleanup, like a SIGKILL) while packing its third bucket."""
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    ready.set()
    go.wait(60)
    count = []

    def die(buffer: torch.Tensor) -> None:
        count.append(1)
        if len(count) == 3:
            os._exit(1)

    with tampering(die):
        send_ipc(
            ((n, weights[n]) for n in info),
            Layout(info, bucket_bytes),
            link=IpcLink(address),
            version=1,
            timeout_s=30,
            use_checksum=True,
            device=torch.device("cpu"),
        )
