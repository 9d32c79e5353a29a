"""Distributed checkpoints: exact resume (sync and async, TP2 / PP2 / DP2 with the distributed
optimizer, in a fresh process), loading into another layout, crash safety, bad checkpoints and
the HF export."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_multirank import paths, run_resume, run_save
from conftest import make_worker
from helpers import clean_env, hf_logprobs, make_batch, make_hf_model, torchrun
from multirank import config

from policyworker.checkpoint.commit import CheckpointError
from policyworker.config import OptimizerConfig, SchedulerConfig
from policyworker.losses import NLLLoss
from policyworker.worker import MegatronPolicyWorker

HERE = Path(__file__).parent
# (tp, pp, distributed optimizer) on two ranks; dp is what remains. The distributed optimizer
# runs with megatron's overlapped grad reduce and param gather: a save right after a step must
# complete the gather the next forward would have made.
LAYOUTS = {"tp2": (2, 1, False), "pp2": (1, 2, False), "dp2-distopt-overlapped": (1, 1, True)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # odd vocabulary (TP2 pads it) and tied embeddings (PP2 keeps a copy on the last stage)
    folder = tmp_path_factory.mktemp("ckpt_model")
    return make_hf_model(folder, "qwen2", vocab_size=101, tie_word_embeddings=True)


def run_jobs(jobs: list[dict]) -> None:
    """`jobs` (see `ckpt_multirank`) in turn, in one 2-rank launch."""
    spec = Path(jobs[0]["out"]).with_suffix(".jobs.json")
    spec.write_text(json.dumps([{"flags": [], **j} for j in jobs], default=str))
    torchrun(HERE / "ckpt_multirank.py", spec)


def save_then_resume(jobs: dict[str, dict], folder: Path) -> dict[str, dict]:
    """Each job saved in one launch and resumed in a second, fresh one; jobs with a `ckpt` of
    their own are only resumed. {name: {"save": ..., "resume": ...}} (what rank 0 wrote)."""
    for name, job in jobs.items():
        job.setdefault("ckpt", folder / name)
    own = {n: j for n, j in jobs.items() if j["ckpt"] == folder / n}
    if own:
        run_jobs([{**j, "mode": "save", "out": folder / f"{n}.save.pt"} for n, j in own.items()])
    run_jobs([{**j, "mode": "resume", "out": folder / f"{n}.resume.pt"} for n, j in jobs.items()])
    runs: dict[str, dict] = {name: {} for name in jobs}
    for name in jobs:
        for kind in ("save", "resume") if name in own else ("resume",):
            runs[name][kind] = torch.load(folder / f"{name}.{kind}.pt", weights_only=False)
    return runs


def _assert_bitwise(saved: dict, resumed: dict) -> None:
    assert torch.equal(saved["lp_at_save"], resumed["lp_at_save"])
    for a, b in zip(saved["train"], resumed["train"], strict=True):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    assert torch.equal(saved["lp_final"], resumed["lp_final"])


def _assert_close(saved: dict, resumed: dict, rel: float = 1e-5) -> None:
    torch.testing.assert_close(resumed["lp_at_save"], saved["lp_at_save"], rtol=0, atol=1e-5)
    for a, b in zip(saved["train"], resumed["train"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel)
    torch.testing.assert_close(resumed["lp_final"], saved["lp_final"], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def two_rank_runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every layout saved on two ranks and resumed in a fresh launch; and a one-rank checkpoint
    (saved here, in the test process) resumed under TP2. Two launches in all."""
    folder = tmp_path_factory.mktemp("two_rank_runs")
    jobs: dict[str, dict] = {
        layout: {
            "model": model_dir,
            "tp": tp,
            "pp": pp,
            "flags": ["distopt", "overlap"] if d else [],
        }
        for layout, (tp, pp, d) in LAYOUTS.items()
    }
    one = folder / "one-rank"
    saved_one = run_save(MegatronPolicyWorker(config(str(model_dir), tp=1, pp=1)), one)
    jobs["one-rank-into-tp2"] = {"model": model_dir, "tp": 2, "pp": 1, "ckpt": one}
    hybrid = make_hf_model(folder / "qwen3_5", "qwen3_5", vocab_size=101)
    jobs["qwen3_5-tp2"] = {"model": hybrid, "tp": 2, "pp": 1, "flags": ["sp"]}
    jobs["lora-pp2"] = {"model": model_dir, "tp": 1, "pp": 2, "flags": ["lora"]}
    runs = save_then_resume(jobs, folder)
    runs["one-rank-into-tp2"]["save"] = saved_one
    return {**runs, "ckpts": {name: job["ckpt"] for name, job in jobs.items()}}


@pytest.mark.processes
@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_resume_and_reshard_on_load(layout, model_dir, two_rank_runs):
    """Save at step 1 (sync and async), run 3 more steps; a fresh 2-rank process loads step 1
    and runs the same 3 steps bit for bit, from the sync and from the async checkpoint. Then
    one rank (TP1, PP1, DP1) loads the same checkpoint and continues within 1e-5."""
    _, _, distopt = LAYOUTS[layout]
    saved, resumed = two_rank_runs[layout]["save"], two_rank_runs[layout]["resume"]
    _assert_bitwise(saved, resumed)
    _assert_bitwise(saved, {"lp_at_save": resumed["lp_at_save"], **resumed["async"]})

    ckpt = two_rank_runs["ckpts"][layout]
    weights, optim = paths(ckpt, "sync")
    single = MegatronPolicyWorker(
        config(str(model_dir), tp=1, pp=1, distopt=distopt),
        weights_path=str(weights),
        optimizer_path=str(optim),
    )
    _assert_close(saved, run_resume(single, ckpt))


@pytest.mark.processes
def test_gated_deltanet_checkpoints_resume_exactly_and_load_into_one_rank(two_rank_runs):
    """Qwen3.5 under TP2 + SP (each Gated DeltaNet layer's in-projection and conv saved block
    by block, its per-head parameters split, the norm whole): a fresh TP2 run resumes bit for
    bit, and one rank loads the same checkpoint and continues within 1e-5."""
    job = two_rank_runs["qwen3_5-tp2"]
    _assert_bitwise(job["save"], job["resume"])
    _assert_bitwise(
        job["save"], {"lp_at_save": job["resume"]["lp_at_save"], **job["resume"]["async"]}
    )
    ckpt = two_rank_runs["ckpts"]["qwen3_5-tp2"]
    weights, optim = paths(ckpt, "sync")
    single = MegatronPolicyWorker(
        config(str(ckpt.parent / "qwen3_5"), tp=1, pp=1),
        weights_path=str(weights),
        optimizer_path=str(optim),
    )
    _assert_close(job["save"], run_resume(single, ckpt))


@pytest.mark.processes
def test_lora_under_pp2_resumes_exactly_and_one_rank_continues_it(model_dir, two_rank_runs):
    """LoRA on two pipeline stages (each stage's adapters drawn as the one-rank model's, the
    tied embedding frozen on both): a fresh PP2 run resumes bit for bit, and one rank loads the
    same checkpoint (adapters and their Adam state) and continues within 1e-5."""
    job = two_rank_runs["lora-pp2"]
    _assert_bitwise(job["save"], job["resume"])
    ckpt = two_rank_runs["ckpts"]["lora-pp2"]
    weights, optim = paths(ckpt, "sync")
    single = MegatronPolicyWorker(
        config(str(model_dir), tp=1, pp=1, lora=True),
        weights_path=str(weights),
        optimizer_path=str(optim),
    )
    _assert_close(job["save"], run_resume(single, ckpt))


@pytest.mark.processes
def test_one_rank_checkpoint_loads_into_tp2(two_rank_runs):
    run = two_rank_runs["one-rank-into-tp2"]
    _assert_close(run["save"], run["resume"])


@pytest.fixture(scope="module")
def saved(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint of one rank after one step, with its weights and optimizer directories."""
    folder = tmp_path_factory.mktemp("saved")
    worker = make_worker(model_dir)
    worker.train(make_batch(), NLLLoss())
    worker.save_checkpoint(folder / "weights", folder / "optim")
    return folder / "weights", folder / "optim"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _params(worker: MegatronPolicyWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}


def test_bad_checkpoints_are_refused_before_any_weight_changes(saved, model_dir, tmp_path):
    weights, _ = saved
    worker = make_worker(model_dir)
    before = _params(worker)
    truncated = _copy(weights, tmp_path / "truncated")
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    corrupt = _copy(weights, tmp_path / "corrupt")
    shard = next(corrupt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    incomplete = _copy(weights, tmp_path / "incomplete")
    (incomplete / "policyworker.json").unlink()
    other_save = tmp_path / "other"
    worker_b = make_worker(model_dir)
    worker_b.save_checkpoint(other_save / "weights", other_save / "optim")
    cases = {
        truncated: "truncated",
        corrupt: "SHA-256 differs",
        incomplete: "not a complete checkpoint",
        tmp_path / "missing": "not a directory",
    }
    for folder, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            worker.load_checkpoint(folder)
    with pytest.raises(CheckpointError, match="another save"):
        worker.load_checkpoint(weights, other_save / "optim")
    after = _params(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_checkpoint_of_another_model_shape_is_refused(saved, tmp_path):
    other = make_hf_model(tmp_path / "wide", "qwen2", vocab_size=101, hidden_size=128)
    with pytest.raises(CheckpointError, match="hidden_size=64"):
        MegatronPolicyWorker(config(str(other), tp=1, pp=1), weights_path=str(saved[0]))


def test_save_argument_errors(saved, model_dir, tmp_path):
    worker = make_worker(model_dir)
    with pytest.raises(ValueError, match="exists"):
        worker.save_checkpoint(saved[0])
    with pytest.raises(ValueError, match="apart from weights_path"):
        worker.save_checkpoint(tmp_path / "w", tmp_path / "w")
    with pytest.raises(ValueError, match="inside the checkpoint directory"):
        worker.save_checkpoint(tmp_path / "w", saved[0] / "optim")
    with pytest.raises(ValueError, match="inside the checkpoint directory"):
        worker.save_checkpoint(saved[1] / "nested" / "w")
    with pytest.raises(ValueError, match="tokenizer_path: this worker has no tokenizer"):
        worker.save_checkpoint(tmp_path / "w", tokenizer_path=tmp_path / "tok")
    no_opt = MegatronPolicyWorker(
        config(str(model_dir), tp=1, pp=1), init_optimizer=False, init_reference_model=False
    )
    with pytest.raises(ValueError, match="no optimizer"):
        no_opt.save_checkpoint(tmp_path / "w", tmp_path / "o")
    with pytest.raises(ValueError, match="optimizer_path"):
        MegatronPolicyWorker(config(str(model_dir), tp=1, pp=1), optimizer_path=str(saved[1]))
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", ["checkpoint.write", "checkpoint.commit"])
def test_killed_during_a_save_leaves_the_previous_checkpoint(model_dir, tmp_path, mode, point):
    script = HERE / "ckpt_crash.py"
    cmd = [sys.executable, str(script), str(model_dir), str(tmp_path), point, mode]
    log = tmp_path / "log.txt"
    with open(log, "w") as f:  # a file, not a pipe: dist-checkpointing's helper process outlives it
        proc = subprocess.Popen(cmd, env=clean_env(), stdout=f, stderr=f, start_new_session=True)
        try:
            code = proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # and its helpers
    assert code == -signal.SIGKILL, log.read_text()[-3000:]  # killed at the fault point
    assert not (tmp_path / "b" / "weights").exists()
    assert not (tmp_path / "b" / "optim").exists()
    leftovers = [p for p in (tmp_path / "b").iterdir()]
    assert leftovers and all(p.name.startswith(".") for p in leftovers)
    assert not any((p / "policyworker.json").exists() for p in leftovers)
    worker = make_worker(model_dir)
    for left in leftovers:
        with pytest.raises(CheckpointError):
            worker.load_checkpoint(left)
    with pytest.raises(CheckpointError, match="a save to it did not finish"):  # names the save
        worker.load_checkpoint(tmp_path / "b" / "weights")
    worker.load_checkpoint(tmp_path / "a" / "weights", tmp_path / "a" / "optim")
    assert worker.state.scheduler.num_steps == 1


def test_export_cli_writes_a_folder_transformers_loads(saved, model_dir, tmp_path):
    from policyworker.cli import main

    out = tmp_path / "hf"
    main(["export", "--checkpoint", str(saved[0]), "--out", str(out)])
    worker = MegatronPolicyWorker(config(str(model_dir), tp=1, pp=1), weights_path=str(saved[0]))
    data = make_batch()
    ours = worker.get_logprobs(data=data)["logprobs"]
    torch.testing.assert_close(hf_logprobs(out, data), ours, rtol=0, atol=1e-4)
    assert json.loads((saved[0] / "policyworker.json").read_text())["step"] == 1
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit) as e:  # an existing --out is replaced only when asked
        main(["export", "--checkpoint", str(saved[0]), "--out", str(out)])
    assert e.value.code == 2
    main(["export", "--checkpoint", str(saved[0]), "--out", str(out), "--force"])
    torch.testing.assert_close(hf_logprobs(out, data), ours, rtol=0, atol=1e-4)


def test_hf_folder_as_weights_path(model_dir):
    worker = MegatronPolicyWorker(config(str(model_dir), tp=1, pp=1), weights_path=str(model_dir))
    base = MegatronPolicyWorker(config(str(model_dir), tp=1, pp=1))
    data = make_batch()
    assert torch.equal(
        worker.get_logprobs(data=data)["logprobs"], base.get_logprobs(data=data)["logprobs"]
    )


def test_integrity_digests_per_chunk_and_names_the_corrupt_file(tmp_path, monkeypatch):
    from policyworker.checkpoint import integrity

    monkeypatch.setattr(integrity, "CHUNK", 1000)
    monkeypatch.setattr(integrity, "_READ", 300)  # several reads per chunk
    files = {"a.distcp": os.urandom(2500), "b.distcp": os.urandom(10), "empty": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    sizes = {name: len(data) for name, data in files.items()}
    recorded = integrity.digests(tmp_path, sizes)
    assert [len(recorded[n]) for n in sorted(files)] == [3, 1, 1]
    import hashlib

    assert recorded["a.distcp"][2] == hashlib.sha256(files["a.distcp"][2000:]).hexdigest()
    integrity.verify(tmp_path, recorded, "weights_path")  # intact: no error
    data = bytearray(files["a.distcp"])
    data[1500] ^= 1  # the second chunk
    (tmp_path / "a.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"weights_path: .* a\.distcp$"):
        integrity.verify(tmp_path, recorded, "weights_path")


def _optimizer_tensors(worker: MegatronPolicyWorker) -> list[torch.Tensor]:
    from policyworker.train.optimizer import optimizer_tensors

    return [t.detach().clone() for t in optimizer_tensors(worker.state.optimizer)]


def test_loads_that_cannot_complete_are_refused_before_anything_changes(model_dir, tmp_path):
    """Another optimizer kind, another precision, the training-state directory as weights, a
    forged manifest over the wrong files: each a `CheckpointError` (a ValueError) naming what
    differs, with weights, optimizer state and schedule as they were."""
    data = make_batch()
    dist = make_worker(
        model_dir, optimizer=OptimizerConfig(lr=1e-2, use_distributed_optimizer=True)
    )
    dist.train(data, NLLLoss())
    dist.save_checkpoint(tmp_path / "d" / "weights", tmp_path / "d" / "optim")
    plain = make_worker(model_dir, optimizer=OptimizerConfig(lr=1e-2))
    plain.train(data, NLLLoss())
    plain.save_checkpoint(tmp_path / "p" / "weights", tmp_path / "p" / "optim")
    forged = _copy(tmp_path / "p" / "optim", tmp_path / "forged")
    manifest = json.loads((forged / "policyworker.json").read_text())
    (forged / "policyworker.json").write_text(json.dumps({**manifest, "kind": "weights"}))
    bf16 = make_worker(model_dir, precision="bfloat16", optimizer=OptimizerConfig(lr=1e-2))
    cases = [
        (plain, (tmp_path / "d" / "weights", tmp_path / "d" / "optim"), "distributed optimizer"),
        (plain, (tmp_path / "p" / "optim",), "'training_state' directory"),
        (plain, (forged,), "does not load"),
        (bf16, (tmp_path / "p" / "weights", tmp_path / "p" / "optim"), "float32 worker"),
    ]
    for worker, args, message in cases:
        before, opt_before = _params(worker), _optimizer_tensors(worker)
        steps = worker.state.scheduler.num_steps
        with pytest.raises(CheckpointError, match=message):
            worker.load_checkpoint(*args)
        after, opt_after = _params(worker), _optimizer_tensors(worker)
        assert all(torch.equal(before[n], after[n]) for n in before), message
        assert all(torch.equal(a, b) for a, b in zip(opt_before, opt_after, strict=True))
        assert worker.state.scheduler.num_steps == steps
    bf16.load_checkpoint(tmp_path / "p" / "weights")  # fp32 weights alone do load into bf16
    plain.train(data, NLLLoss())  # and the refused loads left the worker usable


def test_a_load_restores_the_schedule_whatever_the_worker_did(model_dir, tmp_path, caplog):
    """Into a fresh worker, and into one that trained three steps and changed its lr: the same
    next lr, loss and weights. The checkpoint's settings win over the config's, and say so."""
    data = make_batch()
    opt = OptimizerConfig(lr=1e-2, min_lr=1e-3)
    sched = SchedulerConfig(warmup_steps=3, decay_steps=8, style="cosine")
    saver = make_worker(model_dir, optimizer=opt, scheduler=sched)
    saver.train(data, NLLLoss())
    saver.save_checkpoint(tmp_path / "weights", tmp_path / "optim")
    fresh = make_worker(model_dir, optimizer=opt, scheduler=sched)
    trained = make_worker(model_dir, optimizer=opt, scheduler=sched)
    for _ in range(3):
        trained.train(data, NLLLoss())
    trained.set_learning_rate(5e-2)
    results = []
    for worker in (fresh, trained):
        worker.load_checkpoint(tmp_path / "weights", tmp_path / "optim")
        assert worker.state.scheduler.num_steps == 1
        results.append((worker.train(data, NLLLoss()), _params(worker)))
    (m1, p1), (m2, p2) = results
    assert (m1["lr"], m1["loss"], m1["grad_norm"]) == (m2["lr"], m2["loss"], m2["grad_norm"])
    assert all(torch.equal(p1[n], p2[n]) for n in p1)
    assert fresh.state.scheduler.num_steps == trained.state.scheduler.num_steps == 2

    other = OptimizerConfig(lr=2e-2, min_lr=1e-3, betas=(0.8, 0.99), eps=1e-6)
    worker = make_worker(model_dir, optimizer=other, scheduler=sched)
    with caplog.at_level("WARNING", logger="policyworker.checkpoint.checkpointer"):
        worker.load_checkpoint(tmp_path / "weights", tmp_path / "optim")
    assert "lr: 0.02 -> 0.01" in caplog.text and "betas: (0.8, 0.99) -> (0.9, 0.999)" in caplog.text
    group = worker.state.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8 and group["max_lr"] == 1e-2
    assert worker.train(data, NLLLoss())["lr"] == m1["lr"]
