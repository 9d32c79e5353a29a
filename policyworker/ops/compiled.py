"""One rule for kernels we fuse with torch.compile: compiled on GPU, plain PyTorch on CPU; and
where our Triton kernels run (`triton_runs`).

On CPU the eager function is exact and needs no C++ toolchain or compile time (tests, CI); on GPU
the compiled one fuses the fp32 temporaries of a memory-bound op into a single pass. The compile
is made on the first CUDA call: `torch.compile` itself imports dynamo and inductor (over a second
of a process's start), which a CPU run never needs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

RECOMPILE_LIMIT = 64
"""Graphs dynamo keeps per compiled function (its default, 8, at least this many). One op meets a
graph per dtype, gradient mode, tensor rank and size-1 dimension it sees: an fp32 and a bf16
worker that train, score and decode in one process made RoPE and the RMSNorm pass the 8 (a GPU
test session on an H100), and past the limit dynamo runs the function eagerly, silently: RoPE
then made three temporaries of the queries' size again."""


def cuda_compiled[F: Callable[..., Any]](fn: F) -> F:
    """`fn`, run through `torch.compile(dynamic=True)` when its first argument is a CUDA tensor."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args, **kwargs)
        if compiled is None:
            import torch._dynamo  # what torch.compile imports anyway

            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args, **kwargs)

    return dispatch  # type: ignore[return-value]


def triton_runs(x: torch.Tensor) -> bool:
    """Whether our Triton kernels run on x (`triton_on` its device)."""
    return triton_on(x.device)


def triton_on(device: torch.device) -> bool:
    """Whether our Triton kernels run on `device`: a GPU, or the CPU in Triton's interpreter
    (`TRITON_INTERPRET=1`, the tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors, what our kernels size their grids by (8 off the GPU:
    Triton's interpreter, in the tests)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count
