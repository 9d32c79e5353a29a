"""One rule for kernels we fuse with torch.compile: compiled on GPU, plain PyTorch on CPU.

On CPU the eager function is exact and needs no C++ toolchain or compile time (tests, CI); on GPU
the compiled one fuses the fp32 temporaries of a memory-bound op into a single pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def cuda_compiled[F: Callable[..., Any]](fn: F) -> F:
    """`fn`, run through `torch.compile(dynamic=True)` when its first argument is a CUDA tensor."""
    compiled = torch.compile(fn, dynamic=True)

    def dispatch(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (compiled if x.is_cuda else fn)(x, *args, **kwargs)

    dispatch.__doc__ = fn.__doc__
    dispatch.__name__ = fn.__name__
    return dispatch  # type: ignore[return-value]
