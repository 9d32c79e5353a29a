"""NeMo-RL policy configs read as `PolicyConfig`: a recipe YAML (or its `policy:` section), with
`defaults:` inheritance and OmegaConf-style interpolations (`${policy.x}`, `${..x}`,
`${mul:a, b}`), mapped key by key.

Each reference key is one of: mapped to a field of ours (`MAPPED`), accepted because its value is
what we do anyway (`SAME`), unused by the Megatron backend (the DTensor backend's `optimizer`,
`scheduler`, `dtensor_cfg`, and every key of a section whose `enabled` is false), or unsupported.
Unsupported keys are all named in one `ValueError`, unless the caller asks to ignore them (then
they are listed in a warning) — never dropped silently. docs/nemo-rl-config.md has the table.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from policyworker.config import OptimizerConfig
from policyworker.config.convert import load_yaml, merge, read_recipe  # noqa: F401

log = logging.getLogger(__name__)

# reference key (under `policy.`) -> our dotted field
MAPPED: dict[str, str] = {
    "model_name": "model_name",
    "train_global_batch_size": "train_global_batch_size",
    "train_micro_batch_size": "train_micro_batch_size",
    "logprob_batch_size": "logprob_batch_size",
    "max_total_sequence_length": "max_total_sequence_length",
    "logprob_chunk_size": "logprob_chunk_size",
    "precision": "precision",
    "max_grad_norm": "max_grad_norm",
    "generation.temperature": "temperature",
    "generation.max_new_tokens": "generation.max_new_tokens",
    "generation.stop_token_ids": "generation.stop_token_ids",
    "generation.stop_strings": "generation.stop_strings",
    "make_sequence_length_divisible_by": "sequence_packing.make_sequence_length_divisible_by",
    "megatron_cfg.peft.enabled": "peft.enabled",
    "megatron_cfg.peft.target_modules": "peft.target_modules",
    "megatron_cfg.peft.exclude_modules": "peft.exclude_modules",
    "megatron_cfg.peft.dim": "peft.dim",
    "megatron_cfg.peft.alpha": "peft.alpha",
    "megatron_cfg.peft.dropout": "peft.dropout",
    "megatron_cfg.peft.dropout_position": "peft.dropout_position",
    "megatron_cfg.peft.lora_A_init_method": "peft.lora_A_init_method",
    "megatron_cfg.peft.lora_B_init_method": "peft.lora_B_init_method",
    "megatron_cfg.peft.lora_dtype": "peft.lora_dtype",
    "megatron_cfg.tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "megatron_cfg.pipeline_model_parallel_size": "parallel.pipeline_model_parallel_size",
    "megatron_cfg.context_parallel_size": "parallel.context_parallel_size",
    "megatron_cfg.expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "megatron_cfg.expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "megatron_cfg.moe_token_dispatcher_type": "moe.moe_token_dispatcher_type",
    "megatron_cfg.sequence_parallel": "parallel.sequence_parallel",
    "megatron_cfg.freeze_moe_router": "moe.freeze_moe_router",
    "megatron_cfg.moe_router_dtype": "moe.moe_router_dtype",
    "router_replay.enabled": "moe.router_replay",
    "megatron_cfg.moe_router_load_balancing_type": "moe.moe_router_load_balancing_type",
    "megatron_cfg.moe_aux_loss_coeff": "moe.moe_aux_loss_coeff",
    "megatron_cfg.activation_checkpointing": "recompute.activation_checkpointing",
    "megatron_cfg.recompute_granularity": "recompute.recompute_granularity",
    "megatron_cfg.recompute_modules": "recompute.recompute_modules",
    "megatron_cfg.recompute_method": "recompute.recompute_method",
    "megatron_cfg.recompute_num_layers": "recompute.recompute_num_layers",
    "megatron_cfg.optimizer.lr": "optimizer.lr",
    "megatron_cfg.optimizer.min_lr": "optimizer.min_lr",
    "megatron_cfg.optimizer.weight_decay": "optimizer.weight_decay",
    "megatron_cfg.optimizer.adam_beta1": "optimizer.betas.0",
    "megatron_cfg.optimizer.adam_beta2": "optimizer.betas.1",
    "megatron_cfg.optimizer.adam_eps": "optimizer.eps",
    "megatron_cfg.optimizer.use_distributed_optimizer": "optimizer.use_distributed_optimizer",
    "megatron_cfg.distributed_data_parallel_config.overlap_grad_reduce": (
        "optimizer.overlap_grad_reduce"
    ),
    "megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32": (
        "optimizer.grad_reduce_in_fp32"
    ),
    "megatron_cfg.distributed_data_parallel_config.overlap_param_gather": (
        "optimizer.overlap_param_gather"
    ),
    "megatron_cfg.moe_router_bias_update_rate": "moe.moe_router_bias_update_rate",
    "megatron_cfg.scheduler.lr_decay_style": "scheduler.style",
    "megatron_cfg.scheduler.lr_warmup_iters": "scheduler.warmup_steps",
    "megatron_cfg.scheduler.lr_warmup_init": "scheduler.warmup_init",
    "megatron_cfg.scheduler.lr_decay_iters": "scheduler.decay_steps",
    "megatron_cfg.checkpoint.async_save": "checkpoint.async_save",
    "sequence_packing.enabled": "sequence_packing.enabled",
    "sequence_packing.train_mb_tokens": "sequence_packing.train_mb_tokens",
    "sequence_packing.logprob_mb_tokens": "sequence_packing.logprob_mb_tokens",
    "sequence_packing.algorithm": "sequence_packing.algorithm",
    "dynamic_batching.enabled": "dynamic_batching.enabled",
    "dynamic_batching.train_mb_tokens": "dynamic_batching.train_mb_tokens",
    "dynamic_batching.logprob_mb_tokens": "dynamic_batching.logprob_mb_tokens",
}

# reference key -> (what it must be given the rest, why); a test on the resolved policy section
SAME: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "megatron_cfg.enabled": lambda v, p: v is True,
    "tokenizer.name": lambda v, p: v == p.get("model_name"),  # the worker takes a tokenizer
    "megatron_cfg.optimizer.optimizer": lambda v, p: v == "adam",
    "megatron_cfg.optimizer.bf16": lambda v, p: v == (p.get("precision") == "bfloat16"),
    "megatron_cfg.optimizer.fp16": lambda v, p: v is False,
    "megatron_cfg.optimizer.params_dtype": lambda v, p: v == "float32",
    "megatron_cfg.optimizer.clip_grad": lambda v, p: v == (p.get("max_grad_norm") or 0),
    "megatron_cfg.pipeline_dtype": lambda v, p: v == p.get("precision"),
    "megatron_cfg.scheduler.start_weight_decay": lambda v, p: v == _wd(p),
    "megatron_cfg.scheduler.end_weight_decay": lambda v, p: v == _wd(p),
    "megatron_cfg.scheduler.weight_decay_incr_style": lambda v, p: v == "constant",
    # features we do not have, switched off
    "megatron_cfg.cuda_graph_impl": lambda v, p: v == "none",
    "megatron_cfg.fine_grained_activation_offloading": lambda v, p: v is False,
    # our chunked logits are the fused output layer + logprobs (`_fused_linear_logprobs`)
    "megatron_cfg.use_fused_linear_logprobs": lambda v, p: isinstance(v, bool),
    "megatron_cfg.mtp_num_layers": lambda v, p: v == 0,
    "megatron_cfg.gradient_accumulation_fusion": lambda v, p: v is False,
    "megatron_cfg.use_fused_weighted_squared_relu": lambda v, p: v is False,
    # no fp32 copy of the logits is ever made; the log-softmax accumulates in fp32 either way
    "megatron_cfg.defer_fp32_logits": lambda v, p: isinstance(v, bool),
    "megatron_cfg.force_reconvert_from_hf": lambda v, p: v is False,  # HF weights read directly
    "megatron_cfg.optimizer.optimizer_cpu_offload": lambda v, p: v is False,
    "megatron_cfg.optimizer.optimizer_offload_fraction": lambda v, p: v == 0,
    "megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d": lambda v, p: v is False,
    "megatron_cfg.distributed_data_parallel_config.use_custom_fsdp": lambda v, p: v is False,
    "tokenizer.use_fastokens": lambda v, p: v is False,
    "offload_optimizer_for_logprob": lambda v, p: v is False,
    "megatron_cfg.use_gloo_process_groups": lambda v, p: v is False,  # NCCL on GPU, as here
    # the logprobs of get_logprobs are of the unfiltered distribution
    "generation.top_p": lambda v, p: v == 1.0,
    "generation.top_k": lambda v, p: v is None,
    # mixture of experts: what we run (no expert bias, no DeepEP)
    # the HF config says whether a router has the expert bias (DeepSeek-V3, GLM-4.5)
    "megatron_cfg.moe_router_enable_expert_bias": lambda v, p: isinstance(v, bool),
    "megatron_cfg.moe_enable_deepep": lambda v, p: v is False,
    # how megatron schedules or logs, not what it computes
    "megatron_cfg.moe_permute_fusion": lambda v, p: True,
    "megatron_cfg.moe_shared_expert_overlap": lambda v, p: True,
    "megatron_cfg.moe_per_layer_logging": lambda v, p: True,
}

# reference key -> (the values refused by name, what to use instead): features not built here
# whose recipes must fail by their own key, not by ours or in a list of unsupported keys
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "megatron_cfg.moe_token_dispatcher_type": (
        lambda v: v == "flex",
        "the flex dispatcher (DeepEP / HybridEP) is not built here; use alltoall (the default) "
        "or allgather",
    ),
    "megatron_cfg.moe_enable_deepep": (
        lambda v: v is True,
        "DeepEP is not built here; use moe_token_dispatcher_type alltoall (the default) or "
        "allgather",
    ),
}

# keys whose settings only act on what they belong to, which is off or absent here
_INERT: dict[str, Callable[[dict[str, Any]], bool]] = {
    "megatron_cfg.cuda_graph_": lambda p: _mcore(p).get("cuda_graph_impl") == "none",
    "megatron_cfg.fused_linear_logprobs_chunk_size": lambda p: True,  # `_fused_linear_logprobs`
    "megatron_cfg.recompute_": lambda p: not _mcore(p).get("activation_checkpointing"),
    "megatron_cfg.mtp_": lambda p: not _mcore(p).get("mtp_num_layers"),
    # how megatron's custom FSDP shards, which is off (`use_custom_fsdp: false`)
    "megatron_cfg.distributed_data_parallel_config.data_parallel_sharding_strategy": lambda p: (
        not _mcore(p).get("distributed_data_parallel_config", {}).get("use_custom_fsdp")
    ),
    "megatron_cfg.optimizer.sgd_": lambda p: (
        _mcore(p).get("optimizer", {}).get("optimizer") == "adam"
    ),
    "generation.": lambda p: True,  # the generation engine's other settings
    "generation_batch_size": lambda p: True,  # the HF generation backend's
}

_RESOLVERS: dict[str, Callable[..., Any]] = {
    "mul": lambda a, b: a * b,
    "add": lambda a, b: a + b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}
_SECTION_SWITCH = "enabled"
_MAPPINGS = (  # the policy's sections: each a mapping (or null), never a value
    "generation",
    "generation.vllm_cfg",
    "megatron_cfg",
    "megatron_cfg.optimizer",
    "megatron_cfg.scheduler",
    "megatron_cfg.distributed_data_parallel_config",
    "megatron_cfg.checkpoint",
    "sequence_packing",
    "dynamic_batching",
    "dtensor_cfg",
    "router_replay",
)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


_DTENSOR_ONLY = ("optimizer", "scheduler", "dtensor_cfg")  # the other backend's settings
_NULL_MEANS = {"max_grad_norm": 0.0}  # null: no clipping (0 here); other nulls: our default


def _mcore(policy: dict[str, Any]) -> dict[str, Any]:
    return policy.get("megatron_cfg", {})


def _wd(policy: dict[str, Any]) -> Any:
    return _mcore(policy).get("optimizer", {}).get("weight_decay")


def _accepted(key: str, value: Any, policy: dict[str, Any]) -> bool:
    """Whether a key that maps to nothing of ours changes nothing here: its value is what we do
    (`SAME`), it sets nothing (null, empty), it belongs to what is off or absent (`_INERT`),
    to the DTensor backend, or to a section switched off."""
    if key in SAME:
        return SAME[key](value, policy)
    if value is None or value == {} or value == []:
        return True
    if any(key.startswith(prefix) and inert(policy) for prefix, inert in _INERT.items()):
        return True
    return key.split(".")[0] in _DTENSOR_ONLY or in_disabled_section(policy, key)


def is_nemo_rl(data: dict[str, Any]) -> bool:
    """A NeMo-RL recipe (a `policy:` section) or its policy section (a `megatron_cfg:`)."""
    return isinstance(data.get("policy"), dict) or "megatron_cfg" in data


def policy_dict(data: dict[str, Any], *, ignore_unsupported: bool) -> dict[str, Any]:
    """Our `PolicyConfig` fields (as a nested dict) from a NeMo-RL recipe or policy section."""
    ours, unsupported = policy_fields(data)
    report_unsupported(unsupported, ignore_unsupported=ignore_unsupported)
    return ours


def policy_fields(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Our `PolicyConfig` fields (a nested dict) from a NeMo-RL recipe or policy section, and
    its keys that have no equivalent here (`policy.key=value`)."""
    root = data if isinstance(data.get("policy"), dict) else {"policy": data}
    policy = _resolve(root["policy"], ["policy"], root)  # only what we read is resolved
    for section in _MAPPINGS:  # `generation: vllm` where a mapping belongs
        value = _get(policy, section)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"NeMo-RL config: policy.{section}: expected a mapping, got {value!r}")
    if policy.get("megatron_cfg", {}).get("enabled") is not True:
        raise ValueError(
            "NeMo-RL config: policy.megatron_cfg.enabled: expected true (policyworker is the "
            "Megatron backend; a DTensor policy config has no equivalent here)"
        )
    ours: dict[str, Any] = {}
    unsupported: list[str] = []
    for key, value in leaves(policy):
        refused, advice = REFUSED.get(key, (lambda v: False, ""))
        if refused(value):
            raise ValueError(f"NeMo-RL config: policy.{key}={value!r}: {advice}")
        if key in MAPPED:
            if value is None:  # null: our default, unless it means something (`_NULL_MEANS`)
                value = _NULL_MEANS.get(MAPPED[key])
            if value is not None:
                put(ours, MAPPED[key], value)
        elif not _accepted(key, value, policy):
            unsupported.append(f"policy.{key}={value!r}")
    _fused_linear_logprobs(policy, ours)
    if isinstance(ours.get("optimizer", {}).get("betas"), dict):  # adam_beta1 / adam_beta2
        given, default = ours["optimizer"]["betas"], OptimizerConfig().betas
        ours["optimizer"]["betas"] = [given.get(str(i), default[i]) for i in range(2)]
    return ours, unsupported


def _fused_linear_logprobs(policy: dict[str, Any], ours: dict[str, Any]) -> None:
    """The reference's fused output layer + logprobs (`use_fused_linear_logprobs`, chunks of
    `fused_linear_logprobs_chunk_size` tokens) is what our `logprob_chunk_size` does on every
    path: its chunk size is ours unless `logprob_chunk_size` is given."""
    mcore = _mcore(policy)
    chunk = mcore.get("fused_linear_logprobs_chunk_size")
    if mcore.get("use_fused_linear_logprobs") and chunk and ours.get("logprob_chunk_size") is None:
        ours["logprob_chunk_size"] = chunk


def report_unsupported(
    unsupported: list[str], *, ignore_unsupported: bool, switch: str = "ignore_unsupported=True"
) -> None:
    """All the keys without an equivalent in one `ValueError` (naming the `switch` that ignores
    them), or (`ignore_unsupported`) in one warning."""
    if not unsupported:
        return
    listing = ", ".join(unsupported)
    if not ignore_unsupported:
        raise ValueError(
            f"NeMo-RL config: {len(unsupported)} keys have no equivalent here (pass {switch} "
            f"to load without them): {listing}"
        )
    log.warning("NeMo-RL config: ignoring %d unsupported keys: %s", len(unsupported), listing)


def resolved(data: dict[str, Any], section: str) -> Any:
    """One top-level section of a recipe with its interpolations resolved."""
    return _resolve(data.get(section), [section], data)


def in_disabled_section(tree: dict[str, Any], key: str) -> bool:
    """Whether `key` lies in a section switched off by `enabled: false` (its settings unused)."""
    node: Any = tree
    for part in key.split(".")[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(_SECTION_SWITCH) is False:
            return True
    return False


def leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested mapping."""
    if isinstance(node, dict) and node:
        out = []
        for k, v in node.items():
            out += leaves(v, f"{prefix}{k}.")
        return out
    return [(prefix[:-1], node)]


def put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


# --- interpolation ------------------------------------------------------------------------------


def _resolve(node: Any, path: list[str], root: dict[str, Any], depth: int = 0) -> Any:
    if isinstance(node, dict):
        return {k: _resolve(v, [*path, str(k)], root, depth) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, [*path, str(i)], root, depth) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        return _interpolate(node, path, root, depth)
    return node


def _interpolate(text: str, path: list[str], root: dict[str, Any], depth: int) -> Any:
    if depth > 32:
        raise ValueError(f"NeMo-RL config: {'.'.join(path)}: interpolation too deep (a cycle?)")
    spans = _spans(text)
    if len(spans) == 1 and spans[0] == (0, len(text)):  # the whole value: keep its type
        return _evaluate(text[2:-1], path, root, depth)
    out, last = [], 0
    for start, end in spans:
        out += [text[last:start], str(_evaluate(text[start + 2 : end - 1], path, root, depth))]
        last = end
    return "".join([*out, text[last:]])


def _spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each top-level `${...}` of `text`."""
    spans, i = [], 0
    while (start := text.find("${", i)) >= 0:
        level, j = 0, start
        while j < len(text):
            if text.startswith("${", j):
                level, j = level + 1, j + 2
                continue
            if text[j] == "}":
                level -= 1
                if level == 0:
                    break
            j += 1
        if level:
            raise ValueError(f"NeMo-RL config: unbalanced interpolation in {text!r}")
        spans.append((start, j + 1))
        i = j + 1
    return spans


def _evaluate(expr: str, path: list[str], root: dict[str, Any], depth: int) -> Any:
    name, sep, rest = expr.partition(":")
    if sep and re.fullmatch(r"[a-z_]+", name):
        if name not in _RESOLVERS:
            raise ValueError(f"NeMo-RL config: {'.'.join(path)}: unknown resolver {name!r}")
        args = [_argument(a, path, root, depth) for a in _split_args(rest)]
        try:
            return _RESOLVERS[name](*args)
        except (ArithmeticError, TypeError) as e:  # ${div:4,0}, ${mul:a,[1]}
            raise ValueError(
                f"NeMo-RL config: {'.'.join(path)}: ${{{expr}}}: {type(e).__name__}: {e}"
            ) from None
    return _lookup(expr.strip(), path, root, depth)


def _argument(text: str, path: list[str], root: dict[str, Any], depth: int) -> Any:
    text = text.strip()
    if "${" in text:
        return _interpolate(text, path, root, depth + 1)
    return load_yaml(text)


def _split_args(text: str) -> list[str]:
    args, level, current = [], 0, ""
    for i, ch in enumerate(text):
        if text.startswith("${", i):
            level += 1
        elif ch == "}":
            level -= 1
        if ch == "," and level == 0:
            args.append(current)
            current = ""
        else:
            current += ch
    return [*args, current]


def _lookup(ref: str, path: list[str], root: dict[str, Any], depth: int) -> Any:
    """`a.b.c` from the root; `.x` beside the value, `..x` one level up, and so on."""
    if ref.startswith("."):
        dots = len(ref) - len(ref.lstrip("."))
        keys = [*path[: len(path) - dots], *ref[dots:].split(".")]
    else:
        keys = ref.split(".")
    node: Any = root
    for key in keys:
        if isinstance(node, list) and key.isdigit():
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise ValueError(f"NeMo-RL config: {'.'.join(path)}: ${{{ref}}} names nothing")
    return _resolve(node, keys, root, depth + 1)
