"""CPU shims for megatron-core 0.19 (gloo, no CUDA).

megatron-core assumes CUDA in a few places that our code paths reach:

* `device="cuda"` literals and `torch.cuda.current_device()` used as a device (RoPE, the
  DDP grad buffers, the pipeline schedules, the optimizers);
* `torch.cuda.synchronize` / streams / events / `torch.cuda.manual_seed`;
* the CUDA RNG tracker's get/set of the CUDA generator state;
* `tensor.type()` CUDA type strings that the fp16/bf16 and the distributed optimizers sort
  parameters by;
* `tensor.cuda()` on the last stage's copy of tied embeddings (pipeline parallelism) and in the
  distributed optimizer's checkpoint gather;
* `torch.cuda` calls in dist-checkpointing's writer (a sync after staging, a flag tensor);
* mixture of experts: the router moves its weight to `torch.cuda.current_device()`, the alltoall
  dispatcher makes a `torch.cuda.Stream()` when built, and its `maybe_move_tensor_to_cpu` only
  turns CUDA tensors into host split sizes (gloo's alltoall then gets tensors: `_host_split_sizes`);
  with expert TP under EP its tokens are all-gathered and reduce-scattered in uneven shares, which
  gloo refuses (`_uneven_gather`, `_uneven_reduce_scatter`).

(megatron's grad clipping is not reached: `train.optimizer.optimizer_step` clips.)

Rather than patching torch itself, each affected megatron module gets its own `torch` name bound to
a proxy that forwards everything to torch except CUDA devices, which it maps to the CPU. Everything here is a no-op when CUDA is
available, and asserts the megatron-core version it was written against.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from policyworker.compat.version import require_mcore

# megatron modules whose `torch` global is swapped for the CPU proxy.
_PROXIED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    # mixture of experts: the alltoall dispatcher's D2H stream, the router's and experts' devices
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
)

_active = False


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapped


class _NullStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullStream:
        return self

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cuda_namespace() -> types.SimpleNamespace:
    """What megatron reads from `torch.cuda`, answered for the CPU."""
    return types.SimpleNamespace(
        is_available=lambda: False,
        current_device=lambda: torch.device("cpu"),
        device_count=lambda: 0,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        manual_seed=torch.manual_seed,
        Stream=_NullStream,
        Event=_NullStream,
        current_stream=lambda *a, **k: _NullStream(),
        default_stream=lambda *a, **k: _NullStream(),
        stream=lambda *a, **k: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda: None),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        is_current_stream_capturing=lambda: False,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        graphs=types.SimpleNamespace(is_current_stream_capturing=lambda: False),
        random=types.SimpleNamespace(get_rng_state=lambda *a, **k: torch.get_rng_state()),
        FloatTensor=torch.FloatTensor,
        IntTensor=torch.IntTensor,
        LongTensor=torch.LongTensor,
        BoolTensor=torch.BoolTensor,
    )


class _CpuTorch(types.ModuleType):
    """`torch`, as seen by a megatron module on CPU: CUDA devices become the CPU."""

    _FACTORIES = (
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "arange",
        "randn",
        "rand",
        "zeros_like",
    )

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cuda_namespace()
        for name in self._FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def _cuda_type_strings() -> Iterator[None]:
    """Let `tensor.type()` report CUDA type names while a megatron optimizer is built on CPU.

    Float16OptimizerWithFloat16Params sorts params by `param.type()` strings; on CPU those lack the
    `.cuda` part and it raises. Scoped to that constructor only.
    """
    original = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str) and ".cuda." not in result:
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    torch.Tensor.type = cuda_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _tensor_cuda_stays_on_cpu() -> Iterator[None]:
    """Make `tensor.cuda()` return the tensor itself.

    With tied embeddings and pipeline parallelism, `LanguageModule.setup_embeddings_and_output_layer`
    moves the last stage's embedding copy with `.cuda()` before all-reducing it across stages.
    Scoped to that method only.
    """
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def _run_inside(cls: type, method: str, scope: Callable[[], Any]) -> None:
    """Run `cls.method` inside the context manager `scope()`."""
    original = getattr(cls, method)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with scope():
            return original(self, *args, **kwargs)

    setattr(cls, method, wrapped)


def apply_cpu_patches() -> bool:
    """Install the CPU shims if CUDA is absent. Idempotent; returns whether they are active."""
    global _active
    if _active:
        return True
    if torch.cuda.is_available():
        return False

    require_mcore("cpu", "each shim")
    proxy = _CpuTorch()
    for name in _PROXIED_MODULES:
        module = importlib.import_module(name)
        module.torch = proxy  # type: ignore[attr-defined]

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _cpu_get_rng_state
    random._set_cuda_rng_state = _cpu_set_rng_state

    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    _run_inside(optimizer.Float16OptimizerWithFloat16Params, "__init__", _cuda_type_strings)
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    _run_inside(distrib.DistributedOptimizer, "__init__", _cuda_type_strings)
    # its checkpoint gather ("fully_reshardable" format) moves each shard with `.cuda()`
    _run_inside(
        distrib.DistributedOptimizer, "get_parameter_state_dp_zero", _tensor_cuda_stays_on_cpu
    )
    language_module = importlib.import_module(
        "megatron.core.models.common.language_module.language_module"
    )
    _run_inside(
        language_module.LanguageModule,
        "setup_embeddings_and_output_layer",
        _tensor_cuda_stays_on_cpu,
    )
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes(dispatcher.maybe_move_tensor_to_cpu)
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(
        mappings._reduce_scatter_along_first_dim
    )
    _active = True
    return True


def _host_split_sizes(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's `maybe_move_tensor_to_cpu`, also for CPU tensors: the alltoall dispatcher's
    split sizes must reach gloo as host numbers (numpy), not as tensors."""

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return to_host


def _uneven_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's all-gather along dim 0; with uneven `output_split_sizes` (gloo's all_gather
    wants equal shapes) every rank's rows are padded to the most, gathered, and cut back."""

    def gather(
        input_: torch.Tensor,
        group: Any,
        output_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        most, rest = max(output_split_sizes), input_.shape[1:]
        padded = input_.new_zeros((most, *rest))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * group.size(), *rest))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * most : i * most + n] for i, n in enumerate(output_split_sizes)])

    return gather


def _uneven_reduce_scatter(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's reduce-scatter along dim 0; with uneven `input_split_sizes` (gloo has no such
    reduce_scatter) the whole input is all-reduced and this rank keeps its share."""

    def reduce_scatter(
        input_: torch.Tensor,
        group: Any,
        input_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        whole = input_.contiguous().clone()
        dist.all_reduce(whole, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return whole[start : start + input_split_sizes[group.rank()]].clone()

    return reduce_scatter
