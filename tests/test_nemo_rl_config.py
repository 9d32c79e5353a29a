"""NeMo-RL's own example configs (tests/data/nemo_rl) read as `PolicyConfig`: `defaults:`
inheritance, interpolations, every mapped key, and every key without an equivalent named."""

from pathlib import Path

import pytest
import yaml

from policyworker.config import PolicyConfig, as_policy_config, load_config

DATA = Path(__file__).parent / "data" / "nemo_rl"
MEGATRON = [
    "grpo_math_1B_megatron.yaml",
    "sft_openmathinstruct2_megatron.yaml",
    "distillation_math_megatron.yaml",
    "recipes/llm/dpo-llama3.1-8b-instruct-4n8g-megatron.v2.yaml",
]


@pytest.mark.parametrize("name", MEGATRON)
def test_the_reference_examples_name_what_has_no_equivalent(name, caplog):
    with pytest.raises(ValueError, match=r"policy\.megatron_cfg\.apply_rope_fusion=True") as e:
        load_config(DATA / name)
    assert "ignore_unsupported=True" in str(e.value)
    with caplog.at_level("WARNING", logger="policyworker.config.nemo_rl"):
        cfg = load_config(DATA / name, ignore_unsupported=True)
    assert isinstance(cfg, PolicyConfig) and "apply_rope_fusion" in caplog.text


def test_grpo_example_maps_every_value():
    cfg = load_config(DATA / "grpo_math_1B_megatron.yaml", ignore_unsupported=True)
    assert cfg.model_name == "Qwen/Qwen2.5-1.5B" and cfg.precision == "bfloat16"
    assert (cfg.train_global_batch_size, cfg.train_micro_batch_size) == (512, 4)
    assert cfg.logprob_batch_size == 4  # the base file's own ${policy.train_micro_batch_size}
    assert cfg.max_total_sequence_length == 512 and cfg.max_grad_norm == 1.0
    o, s = cfg.optimizer, cfg.scheduler
    assert (o.lr, o.min_lr, o.weight_decay, o.betas, o.eps) == (
        5e-6,
        5e-7,
        0.01,
        (0.9, 0.999),
        1e-8,
    )
    assert o.use_distributed_optimizer and not o.grad_reduce_in_fp32
    assert (s.style, s.warmup_steps, s.warmup_init, s.decay_steps) == ("constant", 13, 5e-7, 1000)
    p = cfg.sequence_packing
    assert p.enabled and p.train_mb_tokens == p.logprob_mb_tokens == 512 * 4  # ${mul:...}
    assert p.algorithm == "modified_first_fit_decreasing"
    assert cfg.parallel.tensor_model_parallel_size == 1 and cfg.temperature == 1.0


def test_inheritance_and_interpolation_of_the_other_examples():
    dpo = load_config(DATA / MEGATRON[3], ignore_unsupported=True)  # defaults: ../../dpo.yaml
    assert dpo.model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert dpo.parallel.tensor_model_parallel_size == 4 and dpo.parallel.sequence_parallel
    assert dpo.sequence_packing.make_sequence_length_divisible_by == 4  # ${policy.megatron_cfg...}
    sft = load_config(DATA / MEGATRON[1], ignore_unsupported=True)  # two levels of defaults
    assert sft.max_grad_norm == 0.0  # null: no clipping
    assert sft.optimizer.grad_reduce_in_fp32  # the example's own true over sft.yaml's false
    distill = load_config(DATA / MEGATRON[2], ignore_unsupported=True)
    p = distill.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (2, 2)


def test_overrides_use_the_references_key_names():
    cfg = load_config(
        DATA / MEGATRON[0],
        ["policy.megatron_cfg.optimizer.lr=1e-6", "policy.train_micro_batch_size=2"],
        ignore_unsupported=True,
    )
    assert cfg.optimizer.lr == 1e-6 and cfg.train_micro_batch_size == 2
    assert cfg.logprob_batch_size == 2  # ${policy.train_micro_batch_size}, resolved after


def test_a_policy_section_of_supported_keys_loads_without_a_word(tmp_path, caplog):
    section = {
        "model_name": "/ckpt",
        "precision": "float32",
        "max_grad_norm": 0.5,
        "optimizer": None,
        "dtensor_cfg": {"enabled": False, "tensor_parallel_size": 8},
        "megatron_cfg": {
            "enabled": True,
            "context_parallel_size": 2,
            "expert_model_parallel_size": 4,
            "expert_tensor_parallel_size": 2,
            "moe_token_dispatcher_type": "allgather",
            "optimizer": {"lr": 3e-6, "adam_beta2": 0.95, "clip_grad": "${policy.max_grad_norm}"},
            "peft": {"enabled": False, "dim": 8},
        },
    }
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(section))
    with caplog.at_level("WARNING"):
        cfg = load_config(path)
    assert not caplog.text
    assert cfg.parallel.context_parallel_size == 2 and cfg.optimizer.betas == (0.9, 0.95)
    assert (cfg.parallel.expert_model_parallel_size, cfg.parallel.expert_tensor_parallel_size) == (
        4,
        2,
    )
    assert cfg.moe.moe_token_dispatcher_type == "allgather"


@pytest.mark.parametrize(
    "change,match",
    [
        ({"megatron_cfg": {"enabled": False}}, "megatron_cfg.enabled: expected true"),
        ({"megatron_cfg": {"enabled": True, "optimizer": {"clip_grad": 2.0}}}, "clip_grad=2.0"),
        ({"megatron_cfg": {"enabled": True}, "x": "${policy.nothing}"}, "names nothing"),
        ({"megatron_cfg": {"enabled": True}, "x": "${pow:2, 3}"}, "unknown resolver"),
    ],
)
def test_configs_that_cannot_be_read_say_why(tmp_path, change, match):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"model_name": "/ckpt", **change}))
    with pytest.raises(ValueError, match=match):
        load_config(path)


def test_the_dtensor_example_is_refused():
    with pytest.raises(ValueError, match="DTensor"):
        load_config(DATA / "grpo_math_1B.yaml", ignore_unsupported=True)


def test_every_mapped_key_is_in_the_docs_table():
    from policyworker.config.nemo_rl import MAPPED

    table = (Path(__file__).parent.parent / "docs" / "nemo-rl-config.md").read_text()
    for theirs, ours in MAPPED.items():
        assert f"| `{theirs}` | `{ours}` |" in table, theirs


def test_a_policy_dict_is_read_as_its_yaml_is(tmp_path):
    """NeMo-RL passes its policy config as a dict: `as_policy_config` (what `Policy` and the
    worker call on a mapping) reads it as `load_config` reads the same YAML, leaves the caller's
    dict as it was, and refuses what the YAML path refuses, with the same messages."""
    section = {
        "model_name": "/ckpt",
        "precision": "float32",
        "max_grad_norm": 0.5,
        "generation": {"temperature": 0.7, "max_new_tokens": 9},
        "megatron_cfg": {
            "enabled": True,
            "tensor_model_parallel_size": 2,
            "optimizer": {"lr": 3e-6, "clip_grad": "${policy.max_grad_norm}"},
        },
    }
    given = yaml.safe_load(yaml.safe_dump(section))
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(section))
    assert as_policy_config(given) == load_config(path)
    assert given == section  # not resolved or mapped in place
    ours = {"model_name": "/ckpt", "parallel": {"tensor_model_parallel_size": 2}}
    assert as_policy_config(ours).parallel.tensor_model_parallel_size == 2
    with pytest.raises(ValueError, match=r"no equivalent here .*as_policy_config\(config, "):
        as_policy_config({**section, "megatron_cfg": {"enabled": True, "bogus": 1}})
    with pytest.raises(ValueError, match="paralel: unknown field"):
        as_policy_config({"model_name": "/ckpt", "paralel": {}})
    with pytest.raises(ValueError, match="config: expected a PolicyConfig or a mapping"):
        as_policy_config(["model_name"])  # type: ignore[arg-type]


def _bomb(levels: int = 8) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\npolicy:\n  model_name: /x\n  extra: *a{levels - 1}\n"


POLICY = "policy:\n  model_name: /x\n  megatron_cfg: {enabled: true}\n"


@pytest.mark.parametrize(
    "files,match",
    [
        ({"c.yaml": "defaults: c.yaml\n"}, r"c\.yaml: defaults form a cycle"),
        ({"c.yaml": "defaults: d.yaml\n", "d.yaml": "defaults: c.yaml\n"}, "a cycle"),
        ({"c.yaml": POLICY + "  train_global_batch_size: ${div:4,0}\n"}, r"\$\{div:4,0\}"),
        ({"c.yaml": POLICY + "  generation: vllm\n"}, "policy.generation: expected a mapping"),
        ({"c.yaml": "policy:\n  model_name: [x\n"}, r"not valid YAML at line 3, column 1"),
        ({"c.yaml": _bomb()}, "expands to more than 200000 values"),
        ({"c.yaml": POLICY + "  sequence_packing: {enabled: yes}\n"}, "expected true or false"),
    ],
    ids=[
        "self-cycle",
        "cycle",
        "div-by-zero",
        "value-for-section",
        "syntax",
        "alias-bomb",
        "yaml-1.1-bool",
    ],
)
def test_config_files_that_cannot_be_read_fail_at_once_in_one_line(tmp_path, files, match):
    """A `defaults:` cycle died in RecursionError, `${div:4,0}` in ZeroDivisionError, a value
    where a section belongs in AttributeError, an alias bomb in MemoryError after a minute, a
    syntax error in a multi-line parser dump; `yes` was read as true. Each is one line naming
    the file or key, within a second, and `demo --config` exits 2 with it."""
    import time

    from policyworker.cli import main

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match) as e:
        load_config(tmp_path / "c.yaml")
    assert "\n" not in str(e.value) and time.monotonic() - start < 1
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2


def test_recompute_keys_map_and_deepep_is_refused_by_its_own_name(tmp_path):
    """`recompute_method: block` with 2 layers was refused as having no equivalent (and became
    uniform/1 when ignored); the flex dispatcher failed as our key, not the recipe's."""
    mcore = {"enabled": True, "activation_checkpointing": True, "recompute_granularity": "full",
             "recompute_method": "block", "recompute_num_layers": 2}  # fmt: skip
    cfg = as_policy_config({"model_name": "/x", "megatron_cfg": mcore})
    r = cfg.recompute
    assert (r.activation_checkpointing, r.recompute_method, r.recompute_num_layers) == (
        True,
        "block",
        2,
    )
    for key, value in (("moe_token_dispatcher_type", "flex"), ("moe_enable_deepep", True)):
        section = {"model_name": "/x", "megatron_cfg": {"enabled": True, key: value}}
        with pytest.raises(ValueError, match=f"policy.megatron_cfg.{key}=.*use .*alltoall"):
            as_policy_config(section)


def test_the_worker_takes_a_nemo_rl_policy_dict(tmp_path):
    """`MegatronPolicyWorker({...})` raised AttributeError ('dict' object has no attribute
    'parallel'); it builds from NeMo-RL's policy section as from the same `PolicyConfig`."""
    from helpers import make_batch, make_hf_model

    from policyworker.worker import MegatronPolicyWorker

    folder = make_hf_model(tmp_path / "m", "llama")
    section = {"model_name": str(folder), "precision": "float32", "max_total_sequence_length": 64,
               "megatron_cfg": {"enabled": True}}  # fmt: skip
    worker = MegatronPolicyWorker(section, init_optimizer=False, init_reference_model=False)
    assert worker.cfg == as_policy_config(section) and isinstance(worker.cfg, PolicyConfig)
    assert worker.get_logprobs(data=make_batch(batch=2, seq=12))["logprobs"].shape == (2, 12)
