"""Matmuls whose rows do not depend on how many rows they run with (`batch_invariant`).

A decode step multiplies a few rows (one token per sequence); scoring multiplies thousands.
cuBLAS picks its kernel by shape, and for a few rows it may split the inner dimension over
several blocks (split-K), which sums in another order: on an H100 the MLP's down projection
(K = 8192) gave other bits for 0.2-0.4% of its outputs at 1 or 64 rows than the same rows inside
a 6144-row product, and none at 256 rows (`benchmarks/generation_bench.py --mismatch-sources`).
So a decode step's linear layers run on at least `MIN_ROWS` rows, zeros below the real ones,
which are dropped after: a row's result does not depend on its neighbours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

MIN_ROWS = 256
"""Rows a batch-invariant matmul runs with at least (see the module docstring)."""


def pad_rows(x: torch.Tensor, rows: int = MIN_ROWS) -> torch.Tensor:
    """x [..., H] as [max(n, rows), H] (n = x's rows), zero rows after the real ones."""
    flat = x.reshape(-1, x.shape[-1])
    short = rows - flat.shape[0]
    return F.pad(flat, (0, 0, 0, short)) if short > 0 else flat


class _Padded:
    """Hooks of one linear layer: pad its input's rows, then drop the padding's output."""

    def __init__(self) -> None:
        self.shape = torch.Size()

    def before(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.shape = args[0].shape[:-1]
        return (pad_rows(args[0]), *args[1:])

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        """megatron's linear layers return (output, bias): the real rows, in the input's
        leading shape."""
        y, bias = out
        return y[: self.shape.numel()].reshape(*self.shape, y.shape[-1]), bias


class Rows(Protocol):
    """The rows generation's matmuls run on (chosen once: `model/paths.py`)."""

    def around(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Every megatron linear layer of `model` runs on these rows until exit."""
        ...

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] as the rows [n', H] a matmul on it runs with (n' >= x's rows)."""
        ...


class AnyRows:
    """As many rows as the input has."""

    def around(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])


class MinRows:
    """At least `MIN_ROWS` rows (`batch_invariant`)."""

    @contextlib.contextmanager
    def around(self, model: torch.nn.Module) -> Iterator[None]:
        handles = []
        for module in model.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                hooks = _Padded()
                handles.append(module.register_forward_pre_hook(hooks.before))
                handles.append(module.register_forward_hook(hooks.after))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        return pad_rows(x)
