"""One rule for kernels we fuse with torch.compile: compiled on GPU, plain PyTorch on CPU.

On CPU the eager function is exact and needs no C++ toolchain or compile time (tests, CI); on GPU
the compiled one fuses the fp32 temporaries of a memory-bound op into a single pass. The compile
is made on the first CUDA call: `torch.compile` itself imports dynamo and inductor (over a second
of a process's start), which a CPU run never needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def cuda_compiled[F: Callable[..., Any]](fn: F) -> F:
    """`fn`, run through `torch.compile(dynamic=True)` when its first argument is a CUDA tensor."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args, **kwargs)

    return dispatch  # type: ignore[return-value]
