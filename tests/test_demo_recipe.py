"""The demo run from a NeMo-RL GRPO recipe (`demo --config grpo_math_1B_megatron.yaml`), and the
demo's GRPO advantages against the reference's formula."""

import json
from pathlib import Path

import pytest
import torch

from policyworker.cli import main
from policyworker.demo.config import DemoConfig, policy_config
from policyworker.demo.grpo import group_advantages
from policyworker.demo.recipe import load_demo_config

RECIPE = Path(__file__).parent / "data" / "nemo_rl" / "grpo_math_1B_megatron.yaml"


def test_a_recipe_names_every_key_the_demo_has_no_equivalent_for():
    with pytest.raises(ValueError) as e:
        load_demo_config(RECIPE, [])
    msg = str(e.value)
    for key in ("grpo.val_period=10", "grpo.max_num_epochs=1", "logger (", "data (", "env ("):
        assert key in msg
    assert "--ignore-unsupported" in msg and "policy.megatron_cfg.apply_rope_fusion" in msg
    # what the demo does anyway is not named
    for key in ("normalize_rewards", "async_grpo", "cluster.", "loss_fn.", "checkpointing."):
        assert key not in msg


def test_a_recipe_maps_to_the_demo_and_its_workers(tmp_path):
    cfg = load_demo_config(
        RECIPE,
        ["policy.generation.max_new_tokens=8", "policy.max_total_sequence_length=64"],
        ignore_unsupported=True,
    )
    assert (cfg.prompts_per_step, cfg.group_size, cfg.grpo_steps) == (32, 16, 1_000_000)
    assert cfg.seed == 42 and cfg.save_every == 10 and cfg.workers == 1
    assert cfg.normalize_rewards and cfg.leave_one_out_baseline
    assert cfg.loss.reference_policy_kl_penalty == 0.01 and cfg.loss.ratio_clip_max == 0.2
    assert (cfg.precision, cfg.grpo_lr, cfg.micro_batch_size) == ("bfloat16", 5e-6, 4)
    assert (cfg.max_new_tokens, cfg.max_sequence_length) == (8, 64)
    assert cfg.model is None  # a hub name: the built-in model (with a warning)
    policy = policy_config(cfg, tmp_path)
    assert policy.model_name == str(tmp_path) and policy.train_global_batch_size == 512
    assert policy.optimizer.lr == cfg.sft_lr  # the demo's SFT warm-up first, then grpo_lr
    assert policy.optimizer.weight_decay == 0.01 and policy.optimizer.eps == 1e-8
    assert policy.optimizer.use_distributed_optimizer
    assert (policy.scheduler.warmup_steps, policy.scheduler.style) == (13, "constant")
    assert policy.checkpoint.async_save and policy.sequence_packing.enabled


def test_the_demos_own_keys_win_and_recipe_keys_override():
    cfg = load_demo_config(
        RECIPE,
        [
            "grpo.max_num_steps=3",
            "loss.ratio_clip_max=0.28",
            "sft_steps=0",
            "grpo_lr=1e-3",
            "policy.generation.max_new_tokens=4",
        ],
        ignore_unsupported=True,
    )
    assert (cfg.grpo_steps, cfg.loss.ratio_clip_max, cfg.sft_steps) == (3, 0.28, 0)
    assert cfg.grpo_lr == 1e-3 and cfg.loss.reference_policy_kl_penalty == 0.01


def test_the_recipes_global_batch_is_honoured_and_one_it_cannot_run_named(tmp_path):
    """`policy.train_global_batch_size` was dropped with a warning: it is the rollouts per
    optimizer step (512 rollouts a step, 128 a batch: four optimizer steps per GRPO step)."""
    cfg = load_demo_config(RECIPE, ["policy.train_global_batch_size=128"], ignore_unsupported=True)
    assert cfg.train_global_batch_size == 128 and cfg.sft_steps == 0  # no SFT phase unless asked
    assert policy_config(cfg, tmp_path).train_global_batch_size == 128
    with pytest.raises(
        ValueError, match=r"^policy\.train_global_batch_size \(the demo's .*divisor"
    ):
        load_demo_config(RECIPE, ["policy.train_global_batch_size=100"], ignore_unsupported=True)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("worker.model_name=/x", r"worker\.model_name: set by the demo; use --model"),
        ("worker.optimizer.lr=1.0", r"worker\.optimizer\.lr: set by the demo"),
        ("worker.bogus=1", r"worker\.bogus: unknown field"),
    ],
)
def test_worker_fields_the_demo_sets_are_refused(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        cfg = load_demo_config(None, [override])
        policy_config(cfg, tmp_path)


def _reference_advantages(rewards: torch.Tensor, group: int, loo: bool, normalize: bool):
    """NeMo-RL's GRPO estimator (calculate_baseline_and_std_per_prompt, then the division by
    std + 1e-6 where std > 0), transcribed for all-valid samples in groups of `group`."""
    out = torch.zeros_like(rewards)
    for start in range(0, len(rewards), group):
        r = rewards[start : start + group]
        n = len(r)
        mask = (1 - torch.eye(n) if loo else torch.ones(n, n)).to(rewards.dtype)
        num = torch.tensor(n - int(loo), dtype=rewards.dtype)  # a tensor there: 1 / 0 is inf
        baseline = mask @ r / num
        square = mask @ r.pow(2) / num
        std = ((square - baseline.square()) * (num / (num - 1))).sqrt().nan_to_num(0)
        adv = r - baseline
        if normalize:
            nz = std > 0
            adv[nz] = adv[nz] / (std[nz] + 1e-6)
        out[start : start + group] = adv
    return out


@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("group", [2, 3, 8])
def test_group_advantages_equal_the_reference(loo, normalize, group):
    gen = torch.Generator().manual_seed(group)
    rewards = torch.randint(0, 3, (4 * group,), generator=gen).double() / 2
    rewards[:group] = 1.0  # one group without variation
    ours = group_advantages(rewards.tolist(), group, leave_one_out=loo, normalize=normalize)
    ref = _reference_advantages(rewards, group, loo, normalize)
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), ref, atol=1e-9, rtol=0)


@pytest.mark.processes
def test_the_demo_runs_a_nemo_rl_recipe(tmp_path):
    out = tmp_path / "run"
    overrides = [
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=2",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.precision=float32",
        "policy.max_total_sequence_length=32",
        "policy.generation.max_new_tokens=${policy.max_total_sequence_length}",  # clamped
        "sft_steps=2",
        "sft_batch=16",
    ]
    main(["demo", "--config", str(RECIPE), "--ignore-unsupported", "--out", str(out), *overrides])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["sft", "sft", "grpo", "grpo"]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows if r["phase"] == "grpo")


def test_a_policy_section_alone_is_read_too(tmp_path):
    import yaml

    from policyworker.config.nemo_rl import read_recipe

    section = tmp_path / "policy.yaml"
    section.write_text(yaml.safe_dump(read_recipe(RECIPE)["policy"]))
    overrides = ["prompts_per_step=32", "group_size=16", "policy.max_total_sequence_length=64"]
    overrides.append("policy.generation.max_new_tokens=8")
    cfg = load_demo_config(section, overrides, ignore_unsupported=True)
    assert cfg.max_sequence_length == 64 and cfg.grpo_lr == 5e-6
    assert cfg.worker["scheduler"]["warmup_steps"] == 13
    with pytest.raises(ValueError, match="divisor of the 128 rollouts"):  # the demo's 16 x 8
        load_demo_config(section, ["policy.generation.max_new_tokens=8"], ignore_unsupported=True)


def test_the_long_context_keys_reach_the_workers(tmp_path):
    """As the demo's own worker overrides, and as a recipe's keys (#28)."""
    own = load_demo_config(
        None,
        [
            "worker.logprob_chunk_size=64",
            "worker.recompute.activation_checkpointing=true",
            "worker.recompute.recompute_num_layers=2",
        ],
    )
    from_recipe = load_demo_config(
        RECIPE,
        [
            "policy.logprob_chunk_size=1024",
            "policy.megatron_cfg.activation_checkpointing=true",
            "policy.max_total_sequence_length=64",
            "policy.generation.max_new_tokens=8",
        ],
        ignore_unsupported=True,
    )
    for cfg, chunk in ((own, 64), (from_recipe, 1024)):
        policy = policy_config(cfg, tmp_path)
        assert policy.logprob_chunk_size == chunk
        assert policy.recompute.activation_checkpointing
    assert policy_config(own, tmp_path).recompute.recompute_num_layers == 2


def test_a_recipes_layout_the_model_cannot_take_is_refused_before_work_by_its_key(tmp_path):
    """EP 4 on the built-in (dense) model ended in a traceback and exit 1 after work had
    started; it is a one-line error naming the recipe's key, exit 2, nothing written."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["demo", "--config", str(RECIPE), "--ignore-unsupported", "--out", str(out),
              "policy.megatron_cfg.expert_model_parallel_size=4"])  # fmt: skip
    assert e.value.code == 2 and not out.exists()


def test_the_stock_recipes_max_new_tokens_runs_clamped_per_row():
    """The stock `max_new_tokens: ${policy.max_total_sequence_length}` was refused
    ("max_sequence_length: expected > max_new_tokens"): each row is clamped to the context."""
    cfg = load_demo_config(RECIPE, [], ignore_unsupported=True)
    assert cfg.max_new_tokens == cfg.max_sequence_length == 512


def test_demo_help_lists_every_option():
    import dataclasses

    from policyworker.cli import demo_options

    text = demo_options()
    for f in dataclasses.fields(DemoConfig):
        assert f"\n  {f.name} (" in text, f.name
    assert "prompts_per_step (int) = 16" in text and "Prompts per GRPO step." in text


def test_the_recipes_data_section_is_named_when_data_replaces_it(caplog):
    """With --data the recipe's `data:` section was dropped without a word."""
    with caplog.at_level("WARNING", logger="policyworker.demo.recipe"):
        cfg = load_demo_config(RECIPE, ["data=/my/rows.jsonl"], ignore_unsupported=True)
    assert cfg.data == "/my/rows.jsonl"
    assert (
        "the recipe's data: section (12 keys:" in caplog.text
        and "replaced by --data" in caplog.text
    )
