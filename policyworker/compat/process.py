"""What a process of torch, megatron-core and transformers costs to start and to end.

Start — megatron-core 0.19's import: its fused kernels are wrapped in `torch.compile` as its
modules are imported (`megatron.core.jit.jit_fuser = torch.compile`, and a few direct
`@torch.compile`s), and the first `torch.compile` call imports torch._dynamo and inductor —
about 1.6 s of every process's start, also on a CPU where no fused kernel ever runs.

`defer_megatron_compile()` (called when `policyworker` is imported, before megatron-core can be)
makes `torch.compile` lazy while the `megatron.core` package is being imported: each function it
wraps then is compiled by the real `torch.compile`, with the same options, on its first call —
on a machine with CUDA; without one it runs eagerly, as our own fused kernels do
(`ops/compiled.py`): no C++ toolchain, no compile time, the eager numbers (MoE routing reaches
such functions on CPU). Only megatron-core 0.19 is patched; an earlier import of megatron-core leaves it all alone.

End — the interpreter's teardown of those libraries' modules takes over a second after all work
is done. `exit_now()` ends a worker process whose work is finished and committed: it runs what a
normal exit runs (atexit hooks, `weakref.finalize` callbacks such as shared-buffer unlinks,
logging's flush), then leaves without the teardown.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

TARGET = "0.19."


def defer_megatron_compile() -> None:
    """Install the import hook, once, unless megatron-core is imported or not 0.19."""
    if "megatron.core" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return
    if version.startswith(TARGET):
        sys.meta_path.insert(0, _Finder())


def deferred(
    compile_fn: Callable[..., Any],
    fn: Callable[..., Any],
    options: dict[str, Any],
    *,
    compile_here: Callable[[], bool] = lambda: True,
) -> Any:
    """`fn`, compiled by `compile_fn(fn, **options)` on its first call if `compile_here()`, else
    run as it is (a plain function, so that it binds as a method like the function
    `torch.compile` returns)."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = compile_fn(fn, **options) if compile_here() else fn
        return compiled(*args, **kwargs)

    return run


def _lazy(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `torch.compile(model=None, **options)`, decorator form included."""
    import torch

    def lazy_compile(model: Any = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: lazy_compile(fn, **options)
        return deferred(compile_fn, model, options, compile_here=torch.cuda.is_available)

    return lazy_compile


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` (once) and hands it to `_Loader`."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    """Runs the package's import with `torch.compile` lazy (the package imports its submodules)."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        real = torch.compile
        torch.compile = _lazy(real)  # type: ignore[assignment]
        try:
            self.inner.exec_module(module)
        finally:
            torch.compile = real


def exit_now(code: int = 0) -> None:
    """End this process now, after everything a normal exit runs but the module teardown."""
    atexit._run_exitfuncs()  # our hooks, weakref.finalize's, multiprocessing's
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
