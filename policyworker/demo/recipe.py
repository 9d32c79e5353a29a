"""The demo's options from a NeMo-RL GRPO recipe:
`python -m policyworker demo --config grpo_math_1B_megatron.yaml [--ignore-unsupported] [k=v]`.

The recipe's `policy:` section is read by `config.nemo_rl` as for any policy config: the fields
the demo derives itself (`DEMO_SETS`) come from their recipe keys, the rest become
`DemoConfig.worker`. Keys of `grpo:`, `loss_fn:`, `checkpointing:` and `cluster:` map to demo
options (`MAPPED`) or are accepted where their value is what the demo does anyway (`SAME`, null
values, sections switched off). Every other key is named in one `ValueError` (with
`ignore_unsupported`, in one warning), a section the demo has nothing for by its name and size.
Overrides use the recipe's own keys (`grpo.max_num_steps=20`) or the demo's (`sft_steps=0`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from policyworker.config import apply_overrides, from_dict, nemo_rl, read_data
from policyworker.demo.config import DemoConfig
from policyworker.losses.clipped_pg import ClippedPGConfig

log = logging.getLogger(__name__)

# recipe key -> DemoConfig field
MAPPED: dict[str, str] = {
    "grpo.num_prompts_per_step": "prompts_per_step",
    "grpo.num_generations_per_prompt": "group_size",
    "grpo.max_num_steps": "grpo_steps",
    "grpo.seed": "seed",
    "grpo.normalize_rewards": "normalize_rewards",
    "grpo.use_leave_one_out_baseline": "leave_one_out_baseline",
    "checkpointing.save_period": "save_every",
    "cluster.gpus_per_node": "workers",
    "policy.generation.max_new_tokens": "max_new_tokens",
    **{f"loss_fn.{f.name}": f"loss.{f.name}" for f in dataclasses.fields(ClippedPGConfig)},
}

# recipe key -> whether its value is what the demo does, given the resolved recipe
SAME: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "grpo.max_rollout_turns": lambda v, r: v == 1,
    "grpo.batch_multiplier": lambda v, r: v == 1,
    "grpo.use_dynamic_sampling": lambda v, r: v is False,
    "grpo.overlong_filtering": lambda v, r: v is False,
    "grpo.adv_estimator.name": lambda v, r: v == "grpo",
    "grpo.adv_estimator.normalize_rewards": lambda v, r: v == r["grpo"].get("normalize_rewards"),
    "grpo.adv_estimator.use_leave_one_out_baseline": lambda v, r: (
        v == r["grpo"].get("use_leave_one_out_baseline")
    ),
    "grpo.adv_estimator.minus_baseline": lambda v, r: True,  # Reinforce++'s; unused by "grpo"
    "grpo.dynamic_sampling_max_gen_batches": lambda v, r: not r["grpo"].get("use_dynamic_sampling"),
    "checkpointing.save_optimizer": lambda v, r: v is True,
    "cluster.num_nodes": lambda v, r: v == 1,
    "cluster.master_port_range_low": lambda v, r: True,  # ports are picked free here
    "cluster.master_port_range_high": lambda v, r: True,
}

_SECTIONS = ("grpo", "loss_fn", "checkpointing", "cluster")  # read key by key
_POLICY_TO_DEMO = {  # the policy section's fields the demo takes as its own options
    "precision": "precision",
    "max_total_sequence_length": "max_sequence_length",
    "temperature": "temperature",
    "train_micro_batch_size": "micro_batch_size",
    "sequence_packing": "sequence_packing",
    "train_global_batch_size": "train_global_batch_size",
}
_WHOLE = ("policy", *_SECTIONS)


def load_demo_config(
    path: str | Path | None, overrides: list[str], *, ignore_unsupported: bool = False
) -> DemoConfig:
    """The demo's options from its own YAML, a NeMo-RL GRPO recipe or a recipe's `policy:`
    section alone (overrides then name its keys `policy.x`), with dotted overrides."""
    data = read_data(path)
    if nemo_rl.is_nemo_rl(data) and not isinstance(data.get("policy"), dict):
        data = {"policy": data}  # a policy section alone
    section = data.get("data")
    if isinstance(section, dict) and any(o.startswith("data=") for o in overrides):
        log.warning("the recipe's data: section (%d keys: %s) is replaced by --data",
                    len(nemo_rl.leaves(section)), ", ".join(sorted(section)))  # fmt: skip
        del data["data"]
    apply_overrides(data, overrides)
    if not isinstance(data.get("policy"), dict):
        return from_dict(DemoConfig, data)
    try:
        return from_dict(DemoConfig, demo_dict(data, ignore_unsupported=ignore_unsupported))
    except ValueError as e:  # a recipe's value: named by the recipe's key
        raise ValueError(recipe_terms(str(e))) from None


def recipe_terms(message: str) -> str:
    """An error about a value a recipe set, named by the recipe's key (ours beside it)."""
    key, sep, rest = message.partition(":")
    if not sep or " " in key:
        return message
    policy = {ours: f"policy.{ref}" for ref, ours in nemo_rl.MAPPED.items()}
    demo = {ours: ref for ref, ours in MAPPED.items()}
    demo |= {ours: f"policy.{ref}" for ref, ours in _POLICY_TO_DEMO.items()}
    ref = demo.get(key) or policy.get(key.removeprefix("worker."))
    return message if ref is None else f"{ref} (the demo's {key}){sep}{rest}"


def demo_dict(data: dict[str, Any], *, ignore_unsupported: bool) -> dict[str, Any]:
    """`DemoConfig` fields (a nested dict) from a NeMo-RL recipe with the overrides applied; the
    demo's own keys in it (`sft_steps`, `loss.x`, `--model` ...) win over what the recipe maps."""
    names = {f.name for f in dataclasses.fields(DemoConfig)}
    own = {k: v for k, v in data.items() if k in names and not (k == "data" and _section(v))}
    recipe = {k: nemo_rl.resolved(data, k) for k in _WHOLE if k in data}
    mapped: dict[str, Any] = {"sft_steps": 0}  # a GRPO recipe has no SFT phase unless asked
    mapped["worker"], unsupported = _from_policy(data, mapped, own)
    for section in _SECTIONS:
        for key, value in nemo_rl.leaves(recipe.get(section) or {}):
            key = f"{section}.{key}"
            if key in MAPPED and value is not None:
                nemo_rl.put(mapped, MAPPED[key], value)
            elif not _accepted(key, value, recipe):
                unsupported.append(f"{key}={value!r}")
    generation = recipe["policy"].get("generation") or {}
    if generation.get("max_new_tokens") is not None:
        mapped["max_new_tokens"] = generation["max_new_tokens"]
    for name, value in data.items():
        if name not in own and name not in _WHOLE and not _sets_nothing(value):
            size = len(nemo_rl.leaves(value)) if _section(value) else 1
            unsupported.append(f"{name} ({size} keys)")
    nemo_rl.report_unsupported(
        unsupported, ignore_unsupported=ignore_unsupported, switch="--ignore-unsupported"
    )
    return nemo_rl.merge(mapped, own)


def _from_policy(
    data: dict[str, Any], ours: dict[str, Any], own: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """Into `ours`, the demo's options the policy section sets; the rest of it as `worker`
    fields, and its unsupported keys (`own`: the demo's options given directly)."""
    worker, unsupported = nemo_rl.policy_fields(data)
    model = worker.pop("model_name", None)
    if model is not None and "model" not in own:
        if Path(model).is_dir():
            ours["model"] = model
        else:
            log.warning("policy.model_name %s is not a folder here (no model hub): the demo "
                        "trains its built-in model unless --model names one", model)  # fmt: skip
    for ref, field in _POLICY_TO_DEMO.items():
        if ref in worker:
            ours[field] = worker.pop(ref)
    lr = worker.get("optimizer", {}).pop("lr", None)
    if lr is not None:
        ours["grpo_lr"] = lr
    lbs = worker.pop("logprob_batch_size", None)
    if lbs is not None and lbs != ours.get("micro_batch_size"):
        unsupported.append(f"policy.logprob_batch_size={lbs!r} (the demo uses micro_batch_size)")
    return worker, unsupported


def _accepted(key: str, value: Any, recipe: dict[str, Any]) -> bool:
    if key in SAME:
        return SAME[key](value, recipe)
    if value is None or value == {} or value == []:
        return True
    return nemo_rl.in_disabled_section(recipe, key)


def _sets_nothing(value: Any) -> bool:
    """Null, empty, or a section switched off (`enabled: false`)."""
    return value in (None, {}, []) or (_section(value) and value.get("enabled") is False)


def _section(value: Any) -> bool:
    return isinstance(value, dict)
