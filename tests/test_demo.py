"""Smoke test of the main job: a few SFT and GRPO steps write metrics, a plot and an HF export."""

import json
from pathlib import Path

import pytest
import torch
from helpers import hf_logprobs

from policyworker.cli import main
from policyworker.demo.grpo import group_advantages


@pytest.mark.processes
def test_demo_smoke(tmp_path):
    out = tmp_path / "run"
    main(
        [
            "demo",
            "--out",
            str(out),
            "sft_steps=4",
            "grpo_steps=3",
            "prompts_per_step=4",
            "group_size=4",
            "micro_batch_size=8",
            "sft_batch=16",
            "--save-every",
            "3",
        ]
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["sft"] * 4 + ["grpo"] * 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_6"]
    assert [r["step"] for r in rows] == list(range(7))
    assert all({"step", "phase", "loss", "reward_mean"} <= r.keys() for r in rows)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows if r["phase"] == "grpo")
    assert (out / "metrics.png").stat().st_size > 1000
    # the final export loads in transformers and carries the trained weights
    from policyworker.data.batched_data_dict import BatchedDataDict

    ids = torch.tensor([[1, 6, 13, 7, 14, 12, 2]])
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([7]))
    assert (hf_logprobs(out / "hf", data) - hf_logprobs(out / "init", data)).abs().max() > 1e-3


@pytest.mark.processes
def test_demo_samples_in_the_workers_with_engine_megatron(tmp_path):
    """engine=megatron: the workers generate (no refit, no engine process); the generation
    logprobs are the trainer's, so token_mult_prob_error is 1 (fp32)."""
    out = tmp_path / "run"
    main(["demo", "--out", str(out), "engine=megatron", *SMALL])
    rows = _demo_rows(out)
    grpo = [r for r in rows if r["phase"] == "grpo"]
    assert len(grpo) == 3 and all(r["engine"] == "megatron" for r in grpo)
    assert all(r["weight_version"] is None for r in grpo)  # nothing was refitted
    assert all(abs(r["token_mult_prob_error"] - 1) <= 1e-5 for r in grpo)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in grpo)


def _demo_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "refit_s"} for r in rows]  # refit_s: a timing


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """An uninterrupted run that saved every step: read, never changed, by the tests below."""
    full = tmp_path_factory.mktemp("demo_saved") / "full"
    main([*SAVE_EVERY_STEP, "--out", str(full)])
    return full


@pytest.mark.processes
def test_demo_resumes_with_the_same_rows(tmp_path, saved_run):
    """Resumed from step_3 (in SFT) and from step_5 (in GRPO), the run writes the rows of an
    uninterrupted run: weights, optimizer, scheduler, data order and sampler seeds continue.
    The GRPO resume refits with sparse deltas (refit=sparse): its engine, fresh from the HF
    folder, first gets a full resync; each refit reports what it sent; only its own figures
    differ from the IPC run's."""
    full = saved_run
    resumed = tmp_path / "resumed_3"
    main(["demo", "--out", str(resumed), "--resume", str(full / "checkpoints" / "step_3"), *SMALL])
    assert _demo_rows(resumed) == _demo_rows(full)
    sparse = tmp_path / "resumed_5"
    step = full / "checkpoints" / "step_5"
    main(["demo", "--out", str(sparse), "--resume", str(step), "refit=sparse", *SMALL])

    def same(rows: list[dict]) -> list[dict]:  # the engine's versions restart at 1 there
        skip = ("refit_", "weight_version")
        return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]

    assert same(_demo_rows(sparse)) == same(_demo_rows(full))
    refits = [r for r in _demo_rows(sparse) if r["step"] >= 5]
    assert [r["weight_version"] for r in refits] == [1, 2]
    first, second = refits
    # the resync: nothing changed since the resumed weights (its baseline), all sent whole
    assert first["refit_changed_fraction"] == 0
    assert 0.5 * first["refit_full_bytes"] < first["refit_wire_bytes"] < first["refit_full_bytes"]
    assert 0 < second["refit_changed_fraction"] <= 1 and second["refit_wire_bytes"] > 0


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 1.0, 0.0, 1.0, 1.0], group_size=2)
    assert adv[:4] == pytest.approx([0.5**0.5, -(0.5**0.5)] * 2, rel=1e-5)  # sample std
    assert adv[4:] == [0.0, 0.0]


@pytest.mark.processes
def test_demo_on_a_user_checkpoint_and_jsonl(tmp_path):
    """--model/--data: the user's HF folder (with its tokenizer) and prompt/answer pairs; an
    MoE model (a tiny Qwen3-MoE) — its rows report the tokens per expert."""
    from helpers import make_hf_model

    from policyworker.demo.task import char_tokenizer

    tok = char_tokenizer()
    ckpt = make_hf_model(tmp_path / "ckpt", "qwen3_moe", vocab_size=len(tok), seed=3)
    tok.save_pretrained(ckpt)
    data = tmp_path / "tasks.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(10))
        + "\n"
    )
    out = tmp_path / "run"
    main(
        [
            "demo",
            "--model",
            str(ckpt),
            "--data",
            str(data),
            "--out",
            str(out),
            "sft_steps=2",
            "grpo_steps=2",
            "prompts_per_step=4",
            "group_size=2",
            "micro_batch_size=8",
            "sft_batch=8",
        ]
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["sft", "sft", "grpo", "grpo"]
    assert all(r["moe_tokens_per_expert_max"] >= r["moe_tokens_per_expert_min"] for r in rows)
    assert (out / "hf" / "model.safetensors").exists()


def test_bad_jsonl_names_the_line(tmp_path):
    from policyworker.demo.task import load_jsonl

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_jsonl(path)


TWO_WORKERS = ["sft_steps=3", "grpo_steps=2", "prompts_per_step=4", "group_size=4"]
TWO_WORKERS += ["micro_batch_size=8", "sft_batch=16"]


@pytest.fixture(scope="module")
def one_worker_rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("demo_one")
    main(["demo", "--out", str(out), *TWO_WORKERS])
    return _demo_rows(out)


@pytest.mark.processes
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_demo_through_two_workers_matches_one(tmp_path, backend, one_worker_rows):
    """workers=2 (data parallel through the driver), local processes or Ray actors: the same SFT
    losses as one worker, and GRPO steps that run (sampling makes later rows diverge)."""
    main(["demo", "--out", str(tmp_path), "workers=2", f"backend={backend}", *TWO_WORKERS])
    one, two = one_worker_rows, _demo_rows(tmp_path)
    assert [r["phase"] for r in two] == ["sft"] * 3 + ["grpo"] * 2
    for a, b in zip(one[:3], two[:3], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert all(r["weight_version"] >= 1 for r in two[3:])


SMALL = ["sft_steps=4", "grpo_steps=3", "prompts_per_step=4", "group_size=4"]
SMALL += ["micro_batch_size=8", "sft_batch=16"]
SAVE_EVERY_STEP = ["demo", "--save-every", "1", *SMALL]


def _exits_2(argv: list[str], capsys) -> str:
    capsys.readouterr()  # what came before
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "override",
    [
        "sequence_packing.train_mb_tokens=0",
        "seed=1e23",
        "sft_lr=inf",
        "grpo_lr=inf",
        "temperature=nan",
        "loss.reference_policy_kl_penalty=nan",
        "loss.ratio_clip_min=.nan",
        "engine=vllm",
        "worker.generation.max_new_tokens=9",
    ],
)
def test_bad_options_exit_2_before_any_work(tmp_path, capsys, override):
    out = tmp_path / "run"
    err = _exits_2(["demo", "--out", str(out), override], capsys)
    assert override.split("=")[0].split(".")[0] in err
    assert not out.exists()


def test_bad_user_inputs_exit_2_before_any_work(tmp_path, capsys):
    """A truncated weights file, a config.json that does not fit the weights, a null prompt."""
    import shutil

    from policyworker.demo.grpo import tiny_llama
    from policyworker.demo.task import char_tokenizer

    tok = char_tokenizer()
    good = tiny_llama(tmp_path / "good", len(tok), seed=3)
    tok.save_pretrained(good)
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    truncated = Path(shutil.copytree(good, tmp_path / "truncated"))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    mismatched = Path(shutil.copytree(good, tmp_path / "mismatched"))
    cfg = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text(json.dumps({"prompt": None, "answer": "2"}) + "\n")
    out = tmp_path / "run"
    for model, rows, expected in (
        (truncated, data, "truncated"),
        (mismatched, data, "mlp.gate_proj.weight has shape"),
        (good, nulls, "nulls.jsonl:1"),
    ):
        err = _exits_2(
            ["demo", "--model", str(model), "--data", str(rows), "--out", str(out)], capsys
        )
        assert expected in err
        assert not out.exists()


@pytest.mark.processes
def test_a_rerun_after_a_crash_continues_and_destroys_nothing(tmp_path, capsys, saved_run):
    """A run killed between a checkpoint's commit and its loop.json: the same command again
    continues from the last complete step, replaces the incomplete one and ends with the rows
    of an uninterrupted run. A --resume older than the --out's latest step, a corrupt
    loop.json, another model's step folder: exit 2, nothing written."""
    full, crashed = saved_run, tmp_path / "crashed"
    command = SAVE_EVERY_STEP
    import shutil

    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_7")
    (crashed / "checkpoints" / "step_6" / "loop.json").unlink()  # killed before it was written
    metrics = crashed / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:6]))
    main([*command, "--out", str(crashed)])
    assert _demo_rows(crashed) == _demo_rows(full)
    steps = sorted(p.name for p in (crashed / "checkpoints").iterdir())
    assert steps == [f"step_{i}" for i in range(1, 8)]

    before = (full / "metrics.jsonl").read_text()
    step_2 = full / "checkpoints" / "step_2"
    err = _exits_2([*command, "--out", str(full), "--resume", str(step_2)], capsys)
    assert "later complete steps [3, 4, 5, 6, 7]" in err
    corrupt = Path(shutil.copytree(step_2, tmp_path / "corrupt"))
    (corrupt / "loop.json").write_text("{not json")
    err = _exits_2([*command, "--out", str(tmp_path / "new"), "--resume", str(corrupt)], capsys)
    assert "loop.json does not parse" in err
    foreign = Path(shutil.copytree(step_2, tmp_path / "foreign"))  # another model's step
    manifest = json.loads((foreign / "weights" / "policyworker.json").read_text())
    manifest["model"]["hidden_size"] = 256
    (foreign / "weights" / "policyworker.json").write_text(json.dumps(manifest))
    err = _exits_2([*command, "--out", str(tmp_path / "new"), "--resume", str(foreign)], capsys)
    assert "hidden_size=256" in err
    assert (full / "metrics.jsonl").read_text() == before and not (tmp_path / "new").exists()


def test_micro_batch_size_is_clamped_alike_for_sft_and_grpo():
    """One rule: a step with fewer rows per worker than micro_batch_size uses that many."""
    from policyworker.demo.config import DemoConfig

    cfg = DemoConfig(prompts_per_step=2, group_size=2, sft_batch=8, micro_batch_size=64)
    assert cfg.step_mbs(4) == 4 and cfg.step_mbs(8) == 8
    two = DemoConfig(prompts_per_step=2, group_size=2, sft_batch=8, micro_batch_size=64, workers=2)
    assert two.step_mbs(4) == 2
    with pytest.raises(ValueError, match="micro_batch_size"):
        DemoConfig(prompts_per_step=4, group_size=4, sft_batch=16, micro_batch_size=5)


def test_a_reward_of_exactly_1_is_drawn_inside_the_frame(tmp_path, monkeypatch):
    """At a reward of 1.0 the line lay on the plot's top border: the panel looked empty."""
    from policyworker.demo import plot

    figures: list = []
    monkeypatch.setattr(plot.plt, "close", figures.append)
    rows = [{"step": s, "phase": "grpo", "loss": 0.1, "reward_mean": 1.0} for s in range(3)]
    plot.plot_metrics(rows, tmp_path / "m.png")
    low, high = figures[0].axes[1].get_ylim()
    assert low < 0.0 and high > 1.0 and (tmp_path / "m.png").stat().st_size > 0
