"""The driver (`Policy`): named sharding, the local and Ray backends against one in-process
worker, failures that surface with the rank named and leave nothing running, bad layouts."""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest
import torch
from driver_faults import DriverOnlyLoss, FailingLoss, interrupt
from helpers import make_batch, make_hf_model

from policyworker import Policy, WorkerError
from policyworker.config import ParallelConfig, PolicyConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import BatchValidationError
from policyworker.driver.dispatch import Split, balanced_split, split_rows
from policyworker.driver.group import Answers
from policyworker.losses import ClippedPGLoss, FullDistillationLoss
from policyworker.parallel.dims import ParallelDims
from policyworker.worker import MegatronPolicyWorker

pytestmark = pytest.mark.processes

LENGTHS = [12, 11, 12, 10, 3, 4, 2, 5]
TOPK = 4


def config(folder: Path, tp: int = 1) -> PolicyConfig:
    return PolicyConfig(
        model_name=str(folder),
        precision="float32",
        train_global_batch_size=8,
        train_micro_batch_size=2,
        logprob_batch_size=2,
        max_total_sequence_length=64,
        parallel=ParallelConfig(tensor_model_parallel_size=tp),
        generation={"max_new_tokens": 6},
    )


def results(worker: MegatronPolicyWorker | Policy, folder: Path) -> dict[str, object]:
    """What any group must agree on with one worker: outputs before and after two GRPO steps
    and a step of full-vocabulary distillation (the model's own head as the teacher's, random
    teacher hidden states)."""
    data = make_batch(batch=8, seq=12, lengths=LENGTHS)
    topk = worker.get_topk_logits(data=data, k=TOPK)
    out = {
        "logprobs": worker.get_logprobs(data=data)["logprobs"],
        "reference": worker.get_reference_policy_logprobs(data=data)["reference_logprobs"],
        "topk_logits": topk["topk_logits"],
        "topk_indices": topk["topk_indices"],
        "train": [worker.train(data, ClippedPGLoss()) for _ in range(2)],
    }
    worker.load_opd_full_teacher_lm_head({"model_name": str(folder)}, 0)
    hidden = torch.randn(8, 12, 64, generator=torch.Generator().manual_seed(3))
    opd = BatchedDataDict({**data, "teacher_full_payload": hidden})
    out["train"].append(worker.train(opd, FullDistillationLoss()))
    prompts = BatchedDataDict({"input_ids": data["input_ids"],
                               "input_lengths": (data["input_lengths"] + 1) // 2})  # fmt: skip
    generated = worker.generate(data=prompts, seed=11)  # shards of different widths
    # copies of one prompt (GRPO's groups): each row's draws are keyed by its index in the
    # whole batch, so the copies differ, and alike for any number of data-parallel workers
    copies = prompts.select_indices([0] * 8)
    return out | {
        "logprobs_after": worker.get_logprobs(data=data)["logprobs"],
        "generated_ids": generated["output_ids"],
        "generated_logprobs": generated["logprobs"],
        "copies_ids": worker.generate(data=copies, seed=12)["output_ids"],
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("driver"), "llama")


@pytest.fixture(scope="module")
def single(model_dir: Path) -> dict[str, object]:
    return results(MegatronPolicyWorker(config(model_dir)), model_dir)


def assert_equal_results(got: dict, want: dict) -> None:
    assert torch.equal(got["generated_ids"], want["generated_ids"])
    assert torch.equal(got["copies_ids"], want["copies_ids"])
    assert len({tuple(r) for r in got["copies_ids"].tolist()}) == 8
    for key in ("logprobs", "reference", "topk_logits", "logprobs_after", "generated_logprobs"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=key)
    assert torch.equal(got["topk_indices"], want["topk_indices"])
    for g, w in zip(got["train"], want["train"], strict=True):
        for key in ("loss", "grad_norm", "actor_loss", "probs_ratio", "global_valid_toks"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"worker processes still running: {alive}")


# --- named sharding and the batch plumbing (no processes) -----------------------------------------


def test_the_mesh_follows_megatrons_rank_order():
    mesh = ParallelDims.from_world(world_size=8, tp=2, pp=2, cp=1)
    assert mesh.dp == 2 and mesh.shape == (2, 2, 1, 2)
    # megatron: rank = ((pp * DP + dp) * CP + cp) * TP + tp
    for r in range(8):
        c = mesh.coords(r)
        assert r == ((c["pp"] * 2 + c["dp"]) * 1) * 2 + c["tp"]
        assert mesh.rank(**c) == r
    assert mesh.ranks_along("tp", 5) == [4, 5]
    assert mesh.ranks_along("pp", 1) == [1, 5]
    assert mesh.ranks_along("dp", 0) == [0, 2]
    assert mesh.replica(1) == [2, 3, 6, 7] and mesh.leader(1) == 6  # on the last stage


@pytest.mark.parametrize(
    ("world", "sizes", "field"),
    [
        (3, {"tp": 2}, "num_workers"),
        (0, {}, "num_workers"),
        (4, {"cp": 0}, "context_parallel"),
        (4, {"ep": 0}, "expert_model_parallel"),
        (2, {"ep": 2, "etp": 2}, r"etp\*ep\*pp = 2\*2\*1 = 4 \(the experts' grid\)"),
    ],
)
def test_the_mesh_refuses_bad_sizes(world, sizes, field):
    sizes = {"tp": 1, "pp": 1, "cp": 1, **sizes}
    with pytest.raises(ValueError, match=field):
        ParallelDims.from_world(world_size=world, world_field="num_workers", **sizes)


def test_master_ports_stay_out_of_the_range_outgoing_connections_take(monkeypatch):
    """A port from bind(0) can be taken by another test's connection before the store binds it
    (a run of the suite met EADDRINUSE so): free_port picks below the ephemeral range."""
    import itertools
    import socket

    from policyworker.parallel import dims

    low, _ = dims._ephemeral_range()
    assert all(dims._LOWEST_PORT <= dims.free_port() < low for _ in range(50))
    with socket.socket() as listener:  # a port some server holds is never handed out
        listener.bind(("", dims.free_port()))
        listener.listen()
        held = listener.getsockname()[1]
        candidates = itertools.chain([held, held], itertools.count(held + 1))

        class Scripted:
            def randrange(self, start: int, stop: int) -> int:
                return next(candidates)

        monkeypatch.setattr(dims.random, "SystemRandom", Scripted)
        assert dims.free_port() > held
    monkeypatch.setattr(dims, "_ephemeral_range", lambda: (1024, 65535))  # no room below: bind(0)
    assert 1024 <= dims.free_port() <= 65535


def test_shards_are_equal_in_rows_balanced_in_tokens_and_keep_examples_whole():
    rows = balanced_split(LENGTHS, 2)
    assert sorted(i for r in rows for i in r) == list(range(8)) and [len(r) for r in rows] == [4, 4]
    tokens = [sum(LENGTHS[i] for i in r) for r in rows]
    assert abs(tokens[0] - tokens[1]) <= 2  # contiguous halves: 45 vs 14
    pairs = split_rows(LENGTHS, 2, Split.GLOBAL_BATCHES, block=4, unit=2)
    for shard in pairs:  # each global batch of 4 rows gives each shard one whole pair
        assert [i // 2 for i in shard[::2]] == [i // 2 for i in shard[1::2]]
        assert [i // 4 for i in shard] == [0, 0, 1, 1]


# --- groups against one worker ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_local_group_equals_one_worker(layout, model_dir, single):
    with Policy(config(model_dir, tp=2 if layout == "tp2" else 1), num_workers=2) as policy:
        assert_equal_results(results(policy, model_dir), single)
        pids = policy.pids
    assert_gone(pids)


def test_ray_group_equals_one_worker(model_dir, single):
    with Policy(config(model_dir), num_workers=2, backend="ray") as policy:
        assert_equal_results(results(policy, model_dir), single)
        pids = policy.pids
    assert_gone(pids)


# --- failures ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_failures_name_the_rank_end_in_bounded_time_and_leave_nothing(backend, model_dir):
    data = make_batch(batch=8, seq=12, lengths=LENGTHS)
    # 1. Every rank refuses a bad argument: the error names the rank, the group stays usable.
    # 2. One rank raises inside a step while the other waits for it in a collective: the
    #    call fails within failure_timeout_s and the group is broken.
    policy = Policy(config(model_dir), num_workers=2, backend=backend, failure_timeout_s=3)
    with pytest.raises(ValueError, match="k: expected") as e:  # the worker's own type
        policy.get_topk_logits(data=data, k=0)
    cause = e.value.__cause__
    assert isinstance(cause, WorkerError) and not cause.broken
    assert (
        "rank 0 failed get_topk_logits" in str(cause) and "ValueError: k: expected" in cause.detail
    )
    assert policy.get_logprobs(data=data)["logprobs"].shape == (8, 12)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed train") as e:
        policy.train(data, FailingLoss(rank=1, how="raise"))
    assert time.monotonic() - start < 30
    assert e.value.broken and "RuntimeError: injected failure" in e.value.detail
    with pytest.raises(WorkerError, match="rank 1 failed train"):
        policy.get_logprobs(data=data)  # a broken group refuses every call
    pids = policy.pids
    policy.shutdown()
    assert_gone(pids)
    # 3. A rank's process dies mid-call: the call fails at once; a new group starts afterwards.
    policy = Policy(config(model_dir), num_workers=2, backend=backend, failure_timeout_s=3)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed train") as e:
        policy.train(data, FailingLoss(rank=1, how="kill"))
    assert time.monotonic() - start < 30 and e.value.broken
    pids = policy.pids
    policy.shutdown()
    assert_gone(pids)
    with Policy(config(model_dir), num_workers=1, backend=backend) as policy:
        assert policy.get_logprobs(data=data)["logprobs"].shape == (8, 12)
        pids = policy.pids
    assert_gone(pids)
    if backend == "ray":  # the local Ray cluster this driver started is gone too
        time.sleep(1)
        left = [p.cmdline() for p in psutil.Process().children(recursive=True) if p.is_running()]
        assert not [c for c in left if any("ray" in part for part in c)], left


def test_bad_layouts_and_batches_are_refused_before_anything_runs(model_dir):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="num_workers"):
        Policy(config(model_dir, tp=2), num_workers=3)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        Policy(config(model_dir, tp=3), num_workers=3)  # 4 heads do not split over 3
    with pytest.raises(ValueError, match="backend"):
        Policy(config(model_dir), backend="mpi")
    with pytest.raises(ValueError, match="failure_timeout_s"):
        Policy(config(model_dir), failure_timeout_s=0)
    assert psutil.Process().children(recursive=True) == before
    with Policy(config(model_dir), num_workers=2) as policy:
        data = make_batch(batch=8, seq=12, lengths=LENGTHS)
        bad = make_batch(batch=8, seq=12, lengths=LENGTHS)
        bad["input_ids"][0, 0] = 10_000
        with pytest.raises(BatchValidationError, match="input_ids"):
            policy.get_logprobs(data=bad)
        with pytest.raises(ValueError, match="gbs"):
            policy.train(data, ClippedPGLoss(), gbs=3)
        with pytest.raises(ValueError, match="data_parallel"):
            policy.get_logprobs(data=data.slice(0, 1))
        with pytest.raises(ValueError, match="send"):
            policy.stream_weights_via_ipc_zmq(send=[True])


def test_ray_group_joins_a_running_cluster_and_leaves_it_running(model_dir, tmp_path):
    """Given an address, the driver joins that cluster (no local one of its own) and, at
    shutdown, removes only its actors."""
    import subprocess
    import sys

    from policyworker.parallel.dims import free_port

    ray = [str(Path(sys.executable).parent / "ray")]
    port = free_port()
    start = [*ray, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false"]
    subprocess.run(start, check=True, capture_output=True, timeout=120)
    try:
        with Policy(
            config(model_dir), num_workers=1, backend="ray", ray_address=f"127.0.0.1:{port}"
        ) as policy:
            data = make_batch(batch=2, seq=12)
            assert policy.get_logprobs(data=data)["logprobs"].shape == (2, 12)
            pids = policy.pids
        assert_gone(pids)
        status = subprocess.run(
            [*ray, "status", f"--address=127.0.0.1:{port}"], capture_output=True, timeout=60
        )
        assert status.returncode == 0  # the cluster is still up
    finally:
        subprocess.run([*ray, "stop", "--force"], capture_output=True, timeout=120)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_no_call_ever_takes_another_calls_answer(backend, model_dir, monkeypatch):
    """The driver left a call early (Ctrl-C after sending, a worker that cannot unpickle the
    arguments): the next call gets its own answer. Interrupted while sending: the group is
    broken, and says so."""
    a = make_batch(batch=8, seq=12, lengths=LENGTHS)
    b = make_batch(batch=8, seq=12, lengths=LENGTHS[::-1], seed=1)
    policy = Policy(config(model_dir), num_workers=2, backend=backend, failure_timeout_s=5)
    try:
        want_b = policy.get_logprobs(data=b)["logprobs"]
        group = policy._group
        interrupt(monkeypatch, group, "_collect")
        with pytest.raises(KeyboardInterrupt):
            policy.get_logprobs(data=a)
        torch.testing.assert_close(policy.get_logprobs(data=b)["logprobs"], want_b, atol=0, rtol=0)
        interrupt(monkeypatch, group, "_collect")
        with pytest.raises(KeyboardInterrupt):
            policy.get_topk_logits(data=a, k=TOPK)
        metrics = policy.train(a, ClippedPGLoss())  # not the top-k answer still on its way
        assert "loss" in metrics and "topk_logits" not in metrics
        interrupt(monkeypatch, group, "_collect")
        with pytest.raises(KeyboardInterrupt):
            policy.train(a, ClippedPGLoss())  # runs to its end on the workers
        after = policy.get_logprobs(data=b)["logprobs"]
        assert after.shape == (8, 12) and not torch.equal(after, want_b)  # two steps later
        torch.testing.assert_close(policy.get_logprobs(data=b)["logprobs"], after, atol=0, rtol=0)

        with pytest.raises(WorkerError, match="failed train") as e:
            policy.train(a, DriverOnlyLoss())
        assert not e.value.broken and "policyworker_tests_driver_only" in e.value.detail
        torch.testing.assert_close(policy.get_logprobs(data=b)["logprobs"], after, atol=0, rtol=0)

        if backend == "local":  # an answer read off its pipe, then an interrupt: nothing lost
            interrupt(monkeypatch, Answers, "add")
            with pytest.raises(KeyboardInterrupt):
                policy.get_logprobs(data=a)
            got = policy.get_logprobs(data=b)["logprobs"]  # the old answer was taken, no hang
            torch.testing.assert_close(got, after, atol=0, rtol=0)

        if backend == "local":  # interrupted part-way through reading an answer: out of step
            interrupt(monkeypatch, Connection, "recv_bytes")
            with pytest.raises(KeyboardInterrupt):
                policy.get_logprobs(data=a)
            with pytest.raises(WorkerError, match=r"interrupted while reading .* out of step") as e:
                policy.get_logprobs(data=b)  # not "died, exit code None"
            assert e.value.broken
            return
        interrupt(monkeypatch, group, "_send", rank=1)
        with pytest.raises(KeyboardInterrupt):
            policy.get_logprobs(data=a)
        with pytest.raises(WorkerError, match="interrupted while sending") as e:
            policy.get_logprobs(data=b)
        assert e.value.broken
    finally:
        pids = policy.pids
        policy.shutdown()
    assert_gone(pids)


def test_shutdown_commits_a_pending_async_save(model_dir, tmp_path):
    data = make_batch(batch=8, seq=12, lengths=LENGTHS)
    policy = Policy(config(model_dir), num_workers=2)
    policy.train(data, ClippedPGLoss())
    policy.save_checkpoint(tmp_path / "weights", tmp_path / "optim", async_save=True)
    with pytest.raises(ValueError, match="still pending"):
        policy.save_checkpoint(tmp_path / "weights", async_save=True)
    policy.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optim", "weights"]
    worker = MegatronPolicyWorker(config(model_dir))
    worker.load_checkpoint(tmp_path / "weights", tmp_path / "optim")
    assert worker.state.scheduler.num_steps == 1


def test_worker_errors_keep_their_type(model_dir, tmp_path):
    """What a worker raised reaches the caller as itself (the README's types), with the rank,
    the call and the remote traceback in a WorkerError as its cause."""
    from policyworker import PhaseError
    from policyworker.checkpoint.commit import CheckpointError

    data = make_batch(batch=8, seq=12, lengths=LENGTHS)
    with Policy(config(model_dir), num_workers=1) as policy:
        with pytest.raises(CheckpointError, match="not a directory") as e:
            policy.load_checkpoint(tmp_path / "missing")
        assert isinstance(e.value.__cause__, WorkerError) and e.value.__cause__.rank == 0
        policy.offload_after_refit()
        with pytest.raises(PhaseError, match="prepare_for_lp_inference"):
            policy.get_logprobs(data=data)
        policy.prepare_for_lp_inference()
        assert policy.get_logprobs(data=data)["logprobs"].shape == (8, 12)


class _Timer:
    """NeMo-RL's Timer protocol, as far as `Policy` uses it: `time(label)` as a context."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    @contextlib.contextmanager
    def time(self, label: str):  # type: ignore[no-untyped-def]
        self.labels.append(label)
        yield


def test_a_nemo_rl_loop_runs_on_policy_unchanged(model_dir, single):
    """The reference's calling convention: its policy config as a dict, `data` positionally,
    `timer=`, `finish_training()`, and `all_mb_metrics` (per micro-batch, every DP rank's)
    beside the reduced metrics."""
    data = make_batch(batch=8, seq=12, lengths=LENGTHS)
    timer = _Timer()
    nemo_rl_policy = {  # NeMo-RL's policy section, a dict, as its loops pass it
        "model_name": str(model_dir),
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_total_sequence_length": 64,
        "generation": {"max_new_tokens": 6},
        "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 1},
    }
    with Policy(nemo_rl_policy, num_workers=2) as policy:
        lp = policy.get_logprobs(data, timer=timer)["logprobs"]
        torch.testing.assert_close(lp, single["logprobs"], atol=1e-5, rtol=0)
        ref = policy.get_reference_policy_logprobs(data, timer=timer)["reference_logprobs"]
        torch.testing.assert_close(ref, single["reference"], atol=1e-5, rtol=0)
        assert policy.get_topk_logits(data, TOPK)["topk_indices"].shape == (8, 12, TOPK)
        results = policy.train(data, ClippedPGLoss(), timer=timer)
        policy.finish_training()
    mb = results["all_mb_metrics"]
    assert len(mb["loss"]) == 2 * results["num_microbatches"]  # two DP ranks
    assert sum(mb["loss"]) == pytest.approx(results["loss"], rel=1e-5)
    assert results["loss"] == pytest.approx(single["train"][0]["loss"], rel=1e-5)
    phases = {f"get_logprobs/{p}" for p in ("shard_data", "run_workers", "merge_results")}
    assert phases | {"train/shard_data", "train/run_workers"} <= set(timer.labels)
