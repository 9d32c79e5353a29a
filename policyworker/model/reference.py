"""Reference-policy weights: a CPU copy swapped into the live parameters on demand."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ReferenceWeights:
    """Snapshot of parameters (on CPU) that can temporarily replace the live ones, in place.

    In-place copies keep every view valid (megatron DDP's params are views of one buffer), and the
    live values are restored bit for bit on exit, also when the body raises.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self._weights = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}

    @contextlib.contextmanager
    def swapped_into(self, params: dict[str, torch.nn.Parameter]) -> Iterator[None]:
        if set(params) != set(self._weights):
            raise ValueError("reference weights do not match the model's parameters")
        live = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        try:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(self._weights[n])
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(live[n])
