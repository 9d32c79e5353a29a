"""Configs: keyword-only dataclasses, every field documented, loadable from YAML with dotted overrides.

    cfg = PolicyConfig(model_name="/ckpt/llama")                   # every other field defaults
    cfg = load_config("policy.yaml", ["optimizer.lr=1e-6", "precision=bfloat16"])

Invalid values raise `ValueError` naming the field (dotted path) and what was expected.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from policyworker.config.convert import (
    apply_overrides,
    finite,
    from_dict,
    read_data,
    sections_from_dicts,
    to_dict,
)
from policyworker.config.convert import check as _check
from policyworker.config.sections import (
    CheckpointConfig,
    DynamicBatchingConfig,
    GenerationConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    PeftConfig,
    RecomputeConfig,
    RefitConfig,
    SchedulerConfig,
    SequencePackingConfig,
)

__all__ = [
    "CheckpointConfig",
    "DynamicBatchingConfig",
    "GenerationConfig",
    "MoEConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PeftConfig",
    "PolicyConfig",
    "RecomputeConfig",
    "RefitConfig",
    "SchedulerConfig",
    "SequencePackingConfig",
    "apply_overrides",
    "finite",
    "from_dict",
    "load_config",
    "read_data",
    "teacher_path",
    "to_dict",
]


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """Everything a `MegatronPolicyWorker` needs. Only `model_name` has no default."""

    model_name: str
    """Hugging Face checkpoint folder (config.json + safetensors)."""
    precision: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter and compute dtype. Optimizer state and grad reduction are fp32 either way."""
    train_global_batch_size: int = 32
    """Sequences per optimizer step (over all data-parallel ranks)."""
    train_micro_batch_size: int = 4
    """Sequences per forward/backward on one rank; gradients accumulate over micro-batches."""
    logprob_batch_size: int = 8
    """Sequences per forward in `get_logprobs` / `get_topk_logits`."""
    max_total_sequence_length: int = 2048
    """Longest prompt + response a batch may hold."""
    logprob_chunk_size: int | None = None
    """Tokens per chunk of the logits (None: a micro-batch's logits at once). The output layer,
    log-softmax, token logprobs, entropy and top-k run chunk by chunk, forward and backward, so
    at most one chunk's [tokens, V/tp] logits exist at a time, in every loss's training path and
    in get_logprobs / get_topk_logits. Costs one more output-layer matmul per chunk (the
    backward recomputes its logits); the numbers equal unchunked ones. In forwards without
    gradient the dense MLPs also run this many tokens at a time (`model/chunked_mlp.py`)."""
    batch_invariant: bool = False
    """Inference forwards whose numbers a decode step reproduces bit for bit, so that a token's
    logprob from `generate` equals its `get_logprobs` score (no train/inference mismatch):
    attention without gradient (scoring, top-k, the prefill) runs row by row the way a decode
    step does (`ops.decode_attention.attention_rows`), a decode step keeps each row's keys in one
    program, and its matmuls run on at least 256 rows (`model/batch_invariant.py`). A GPU
    setting (Triton kernels); the CPU's fp32 numbers match already. Costs: scoring's attention is
    slower than cuDNN's, and a training forward (cuDNN's attention, for its backward) differs
    from `get_logprobs` by bf16 rounding. Dense models (an MoE layer's experts multiply as many
    rows as were routed to them). Not with context parallelism."""
    temperature: float = 1.0
    """Generation temperature: logits are divided by it before logprobs, top-k and the loss."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    opd_full_teacher_lm_head_lifecycle: Literal["none", "offload", "evict"] = "none"
    """Where the teacher LM-head shards of full-vocabulary distillation
    (`load_opd_full_teacher_lm_head`) stay outside training: on the device ("none"), on the host
    ("offload"), or nowhere, read again from the teacher's checkpoint at the next step ("evict").
    Every train step brings them to the device."""
    seed: int = 42
    """Seed for torch and megatron's RNG tracker."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Adam settings."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel sizes."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts options."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recompute."""
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    """Sequence packing (THD bins by token budget)."""
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    """Token-budget micro-batches without packing."""
    refit: RefitConfig = field(default_factory=RefitConfig)
    """Weight hand-over to a generation engine."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Distributed checkpoints."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling in the worker (`generate`)."""
    peft: PeftConfig = field(default_factory=PeftConfig)
    """LoRA adapters on a frozen base."""

    def __post_init__(self) -> None:
        sections_from_dicts(self)
        self.validate()

    def validate(self) -> None:
        _check(
            isinstance(self.model_name, str) and bool(self.model_name),
            "model_name",
            "a folder path",
            self.model_name,
        )
        precisions = ("float32", "bfloat16")
        _check(self.precision in precisions, "precision", f"one of {precisions}", self.precision)
        for name in (
            "train_global_batch_size",
            "train_micro_batch_size",
            "logprob_batch_size",
            "max_total_sequence_length",
        ):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, name, "an int >= 1", value)
        _check(
            self.train_global_batch_size % self.train_micro_batch_size == 0,
            "train_global_batch_size",
            f"a multiple of train_micro_batch_size={self.train_micro_batch_size}",
            self.train_global_batch_size,
        )
        n = self.logprob_chunk_size
        ok = n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1)
        _check(ok, "logprob_chunk_size", "null or an int >= 1 (tokens)", n)
        _check(isinstance(self.batch_invariant, bool), "batch_invariant", "true or false",
               self.batch_invariant)  # fmt: skip
        t, g = self.temperature, self.max_grad_norm
        _check(finite(t) and t > 0, "temperature", "a finite number > 0", t)
        _check(finite(g) and g >= 0, "max_grad_norm", "a finite number >= 0", g)
        life, lifecycles = self.opd_full_teacher_lm_head_lifecycle, ("none", "offload", "evict")
        _check(
            life in lifecycles, "opd_full_teacher_lm_head_lifecycle", f"one of {lifecycles}", life
        )
        ok = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        _check(ok and 0 <= self.seed < 2**63, "seed", "an int in [0, 2**63)", self.seed)
        self.optimizer.validate()
        self.scheduler.validate()
        self.parallel.validate()
        self.moe.validate()
        self.recompute.validate()
        self.sequence_packing.validate()
        self.dynamic_batching.validate()
        self.refit.validate()
        self.checkpoint.validate()
        self.generation.validate()
        self.peft.validate()
        _check(
            not (self.sequence_packing.enabled and self.dynamic_batching.enabled),
            "dynamic_batching.enabled",
            "false when sequence_packing.enabled (choose one)",
            True,
        )
        _check(
            not (self.batch_invariant and self.parallel.context_parallel_size > 1),
            "batch_invariant",
            "false with parallel.context_parallel_size > 1 (no row-wise context-parallel kernel)",
            True,
        )


def load_config[T](
    path: str | Path | None,
    overrides: list[str] | None = None,
    cls: type[T] = PolicyConfig,  # type: ignore[assignment]
    *,
    ignore_unsupported: bool = False,
) -> T:
    """Read a YAML file (or nothing), apply dotted overrides, build and validate `cls`.

    A NeMo-RL recipe or policy section (`policy:` / `megatron_cfg:`; `defaults:` inheritance and
    interpolations included) is read as a `PolicyConfig` through `config.nemo_rl`: every key it
    has that we do not is named in a `ValueError`, unless `ignore_unsupported` (then a warning
    lists them). Overrides use the file's own key names."""
    from policyworker.config import nemo_rl

    data = read_data(path, overrides)
    if cls is PolicyConfig and nemo_rl.is_nemo_rl(data):
        data = nemo_rl.policy_dict(data, ignore_unsupported=ignore_unsupported)
    return from_dict(cls, data)


def as_policy_config(
    config: PolicyConfig | Mapping[str, Any], *, ignore_unsupported: bool = False
) -> PolicyConfig:
    """A policy config as a caller gives it: a `PolicyConfig`, or a mapping — NeMo-RL's policy
    dict (its keys and nesting, `megatron_cfg` inside: NeMo-RL passes its configs as dicts) or
    our own fields — read and checked as `load_config` reads the same YAML (the caller's
    mapping is not changed)."""
    from policyworker.config import nemo_rl

    if isinstance(config, PolicyConfig):
        return config
    _check(isinstance(config, Mapping), "config", "a PolicyConfig or a mapping", config)
    data = copy.deepcopy(dict(config))
    if nemo_rl.is_nemo_rl(data):
        data, unsupported = nemo_rl.policy_fields(data)
        switch = "as_policy_config(config, ignore_unsupported=True)"
        nemo_rl.report_unsupported(
            unsupported, ignore_unsupported=ignore_unsupported, switch=switch
        )
    return from_dict(PolicyConfig, data)


def teacher_path(config: Any) -> str:
    """The HF folder of a teacher's policy config: a `PolicyConfig`, NeMo-RL's dict (its
    `model_name`), or the path itself."""
    if isinstance(config, PolicyConfig):
        return config.model_name
    if isinstance(config, Mapping) and isinstance(config.get("model_name"), str):
        return config["model_name"]
    if isinstance(config, str | Path):
        return str(config)
    raise ValueError(
        "teacher_path_config: expected a PolicyConfig, a dict with model_name, or a path; got "
        f"{type(config).__name__}"
    )
