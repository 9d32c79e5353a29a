"""Refit over IPC into a generation process: refit info, the layout, exact weights and logprobs,
versions, the checksum, dead peers on either side, mismatched refit info, bad arguments."""

import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_worker
from helpers import make_batch, make_hf_model, torchrun
from refit_peers import dying_trainer, kill, tampering
from safetensors.torch import load_file

from policyworker.config import OptimizerConfig, RefitConfig
from policyworker.generation.engine import HFEngine
from policyworker.generation.process import EngineError, GenerationProcess
from policyworker.losses import NLLLoss
from policyworker.model.build import global_named_parameters
from policyworker.ops.mxfp8 import SCALE_SUFFIX, quantize_mxfp8
from policyworker.refit.export import model_tensors
from policyworker.refit.ipc import send_ipc
from policyworker.refit.layout import ALIGN, Layout, RefitError, checksum
from policyworker.refit.receiver import Staging

SMALL_BUFFER = 8192  # several buckets, and tensors larger than a buffer, on the tiny model


def send_tampered(worker, tamper, *, bucket_bytes: int, timeout_s: float, version: int = 1):
    """The worker's refit, checksummed, through `send_ipc` with `tamper` called on every packed
    bucket after its checksum (to corrupt it, or to kill the receiver at a chosen bucket)."""
    src = worker.refit.weights
    info = src.info()
    params = global_named_parameters(worker.state.model)
    with tampering(tamper):
        send_ipc(
            model_tensors(params, src.shape, src.groups, info, src._owners, src.device),
            Layout(info, bucket_bytes),
            link=worker.refit.ipc.link,
            version=version,
            timeout_s=timeout_s,
            use_checksum=True,
            device=worker.device,
        )


def test_refit_info_is_the_export_in_order(llama_dir):
    worker = make_worker(llama_dir)
    info = worker.prepare_refit_info()
    exported = list(worker.export_hf_weights())
    assert list(info) == [n for n, _ in exported]
    for name, tensor in exported:
        assert info[name] == (tuple(tensor.shape), tensor.dtype)
    assert info["model.embed_tokens.weight"][0][0] == worker.shape.vocab_size


def test_a_transport_used_before_it_is_joined_is_refused_by_name(llama_dir):
    """Each refit source knows whether it was joined: a collective or reshard refit, or a sparse
    one without its baseline, raises `ValueError` naming the call to make first; nothing moved."""
    worker = make_worker(llama_dir)
    calls = (
        (worker.broadcast_weights_for_collective, "init_collective"),
        (worker.nccl_reshard_refit, "init_reshard"),
        (worker.finish_remote_sparse_delta_sync, "init_remote_sparse_delta_baseline"),
    )
    for call, first in calls:
        with pytest.raises(ValueError, match=first):
            call(**({"succeeded": True} if first.endswith("baseline") else {}))
    assert worker.weight_version == 0


def test_layout_aligns_every_tensor_and_covers_it_once(llama_dir):
    info = make_worker(llama_dir).prepare_refit_info()
    layout = Layout(info, SMALL_BUFFER)
    names = [s.name for b in layout.buckets for s in b.slots]
    assert names == list(info)
    for b in layout.buckets:
        assert b.start % ALIGN == 0 and b.end % ALIGN == 0
        assert b.nbytes <= SMALL_BUFFER or len(b.slots) == 1  # larger tensors travel alone
    assert any(b.nbytes > SMALL_BUFFER for b in layout.buckets)
    assert all(s.offset % ALIGN == 0 for s in layout.slots.values())


def _staged_refit(
    staging: Staging, layout: Layout, tensors: dict, version: int, flip: bool
) -> None:
    """Stage `tensors` bucket by bucket (the last bucket's byte flipped after its checksum when
    `flip`), then commit."""
    staging.begin(version)
    for bucket in layout.buckets:
        data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for slot in bucket.slots:
            slot.view(data, base=bucket.start).copy_(tensors[slot.name])
        header = {"version": version, "index": bucket.index, "start": bucket.start}
        header |= {"end": bucket.end, "checksum": checksum(data)}
        header["slots"] = [
            (s.name, list(s.shape), "float32", s.offset, s.nbytes) for s in bucket.slots
        ]
        if flip and bucket.index == len(layout.buckets) - 1:
            data[0] ^= 1
        staging.stage(header, data)
    staging.commit(version)


@pytest.mark.parametrize("adopt", [False, True], ids=["copy", "adopt"])
def test_staging_applies_only_whole_verified_refits(adopt):
    """Copy or adopt: each refit's tensors become the live ones exactly; a refit failing at its
    last bucket leaves the live weights (and version) as they were, also once staging reuses the
    bytes that a refit adopted before."""
    gen = torch.Generator().manual_seed(0)
    info = {
        "a": ((64, 8), torch.float32),
        "b": ((3,), torch.float32),
        "c": ((40, 40), torch.float32),
    }
    live = {
        n: torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        for n, (shape, _) in info.items()
    }
    staging = Staging(info, live, adopt=adopt)
    layout = Layout(info, bucket_bytes=4096)
    for version in (1, 2, 3):
        sent = {n: torch.randn(shape, generator=gen) for n, (shape, _) in info.items()}
        _staged_refit(staging, layout, sent, version, flip=False)
        assert staging.version == version
        assert all(torch.equal(live[n], sent[n]) for n in info)
        views = {live[n].untyped_storage().data_ptr() for n in info}
        assert (len(views) == 1) == adopt  # adopted: all views of one staged flat
        bad = {n: torch.randn(shape, generator=gen) for n, (shape, _) in info.items()}
        with pytest.raises(RefitError, match="checksum"):
            _staged_refit(staging, layout, bad, version + 1, flip=True)
        assert staging.version == version
        assert all(torch.equal(live[n], sent[n]) for n in info)


@pytest.mark.processes
@pytest.mark.parametrize(
    "shared,checksum",
    [(True, False), (True, True), (False, True)],
    ids=["direct", "direct-checksummed", "buffers-checksummed"],
)
def test_ipc_refit_is_exact_and_versioned(llama_dir, shared, checksum):
    """Into the engine's shared staging (the default) and through the trainer's buffers."""
    refit = RefitConfig(checksum=checksum)
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-2), refit=refit)
    data = make_batch(batch=4, seq=12)
    info = worker.prepare_refit_info()
    local = HFEngine(str(llama_dir), None, device=torch.device("cpu"))
    with GenerationProcess(str(llama_dir), info, shared_staging=shared) as gen:
        assert gen.version() is None
        for version in (1, 2):
            worker.train(data, NLLLoss())  # new weights for each refit
            gen.begin_refit_ipc(worker.get_zmq_address())
            report = worker.stream_weights_via_ipc_zmq(buffer_size_bytes=SMALL_BUFFER)
            assert gen.end_refit() == report.version == worker.weight_version == version
            assert report.names == len(info) and report.buckets > 1
            assert report.checksum == checksum
            got, sent = gen.weights(), dict(worker.export_hf_weights())
            assert got.keys() == sent.keys()
            assert all(torch.equal(got[n], sent[n]) for n in sent)  # bitwise
            # the same scoring on both sides: equal bit for bit
            with torch.no_grad():
                for name, tensor in sent.items():
                    local.refit_targets({name: info[name]})[name].copy_(tensor)
            ids, lengths = data["input_ids"], data["input_lengths"]
            assert torch.equal(gen.logprobs(ids, lengths), local.logprobs(ids, lengths))


@pytest.mark.processes
@pytest.mark.parametrize("shared", [True, False], ids=["direct", "buffers"])
def test_a_corrupted_byte_fails_the_checksum_and_changes_nothing(llama_dir, shared):
    worker = make_worker(llama_dir)
    info = worker.prepare_refit_info()
    with GenerationProcess(str(llama_dir), info, shared_staging=shared) as gen:
        before = gen.weights()
        gen.begin_refit_ipc(worker.get_zmq_address())

        def flip(buffer):
            buffer[100] ^= 1

        where = "the end of the refit" if shared else "bucket 0"
        with pytest.raises(
            RefitError, match=f"refused {where}: refit: bucket 0 failed its checksum"
        ):
            send_tampered(worker, flip, bucket_bytes=SMALL_BUFFER, timeout_s=10)
        with pytest.raises(RefitError, match="checksum"):
            gen.end_refit()
        after = gen.weights()
        assert gen.version() is None
        assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.processes
def test_a_receiver_killed_mid_refit_fails_the_trainer_in_time(llama_dir):
    worker = make_worker(llama_dir, refit=RefitConfig(timeout_s=2.0))
    info = worker.prepare_refit_info()
    gen = GenerationProcess(str(llama_dir), info)
    gen.begin_refit_ipc(worker.get_zmq_address())
    sent = []

    def kill_after_first(buffer):
        sent.append(1)
        if len(sent) == 2:  # bucket 0 is out and acknowledged by now or soon
            kill(gen)

    start = time.monotonic()
    with pytest.raises(RefitError, match=r"did not answer .* in time") as err:
        send_tampered(worker, kill_after_first, bucket_bytes=SMALL_BUFFER, timeout_s=2.0)
    assert worker.get_zmq_address() in str(err.value)
    assert time.monotonic() - start < 10
    gen.close()
    with GenerationProcess(str(llama_dir), info) as fresh:  # and a new receiver works
        fresh.begin_refit_ipc(worker.get_zmq_address())
        worker.stream_weights_via_ipc_zmq(buffer_size_bytes=SMALL_BUFFER)
        assert fresh.end_refit() == 1


@pytest.mark.processes
def test_a_trainer_killed_mid_refit_fails_the_receiver_in_time(llama_dir, tmp_path):
    info = make_worker(llama_dir).prepare_refit_info()
    address = f"ipc://{tmp_path}/dying.sock"
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    trainer = ctx.Process(
        target=dying_trainer, args=(str(llama_dir), info, address, SMALL_BUFFER, ready, go)
    )
    trainer.start()
    assert ready.wait(120)
    with GenerationProcess(str(llama_dir), info, timeout_s=2.0) as gen:
        before = gen.weights()
        gen.begin_refit_ipc(address)
        go.set()
        trainer.join(30)
        assert trainer.exitcode == 1  # it died after sending two buckets
        start = time.monotonic()
        with pytest.raises(RefitError, match=r"no message from the trainer .* unchanged"):
            gen.end_refit()
        assert time.monotonic() - start < 10
        after = gen.weights()
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert gen.version() is None


@pytest.mark.processes
def test_mismatched_refit_info_is_an_error_on_both_sides(llama_dir, tmp_path):
    worker = make_worker(llama_dir)
    other = make_hf_model(tmp_path, "llama", intermediate_size=128)  # another FFN width
    other_info = make_worker(other).prepare_refit_info()
    with GenerationProcess(str(other), other_info) as gen:
        before = gen.weights()
        gen.begin_refit_ipc(worker.get_zmq_address())
        with pytest.raises(RefitError, match=r"refused the start .*mlp\.gate_proj\.weight sent as"):
            worker.stream_weights_via_ipc_zmq(buffer_size_bytes=SMALL_BUFFER)
        with pytest.raises(RefitError, match=r"mlp\.gate_proj\.weight sent as"):
            gen.end_refit()
        after = gen.weights()
        assert all(torch.equal(before[n], after[n]) for n in before)
    assert worker.weight_version == 0  # a failed refit does not count


def test_bad_refit_arguments_are_refused(llama_dir):
    worker = make_worker(llama_dir)
    for kwargs, field in (
        ({"buffer_size_bytes": -1}, "buffer_size_bytes"),
        ({"buffer_size_bytes": 100}, "buffer_size_bytes"),
        ({"refit_timeout_s": 0}, "refit_timeout_s"),
    ):
        with pytest.raises(ValueError, match=field):
            worker.stream_weights_via_ipc_zmq(**kwargs)
    with pytest.raises(ValueError, match="num_buffers"):
        worker.broadcast_weights_for_collective(num_buffers=0)
    with pytest.raises(ValueError, match="world_size"):
        worker.init_collective("127.0.0.1", 29999, 1)
    assert worker.weight_version == 0


@pytest.fixture(scope="module")
def multirank_refits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model, results folder): a TP2 and a PP2 trainer's refits, in one launch."""
    folder = make_hf_model(  # tied: the last stage's output layer copy is never sent
        tmp_path_factory.mktemp("refit_mr"), "qwen2", vocab_size=128, tie_word_embeddings=True
    )
    out = tmp_path_factory.mktemp("refit_mr_out")
    torchrun(Path(__file__).parent / "refit_multirank.py", folder, out, "tp2:2:1", "pp2:1:2")
    return folder, out


@pytest.mark.processes
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tp2_and_pp2_trainers_refit_one_receiver(layout, multirank_refits):
    """Gathered TP shards and broadcast pipeline stages arrive as the checkpoint's tensors,
    each name once; prequantized to MXFP8, as the quantization of the checkpoint's."""
    folder, out = multirank_refits
    got = torch.load(out / f"{layout}.pt", weights_only=False)
    checkpoint = load_file(folder / "model.safetensors")
    assert got["weights"].keys() == checkpoint.keys()
    assert all(torch.equal(got["weights"][n], checkpoint[n]) for n in checkpoint)
    assert got["version"] == got["report"].version == 1
    mx, names = got["mxfp8_weights"], got["mxfp8_names"]  # prequantized: the same weights
    assert len(names) > 10 and len(mx) == len(checkpoint) + len(names)
    for name, tensor in checkpoint.items():
        if name in names:
            values, scales = quantize_mxfp8(tensor)
            assert torch.equal(mx[name].view(torch.uint8), values.view(torch.uint8)), name
            assert torch.equal(mx[name + SCALE_SUFFIX], scales), name
        else:
            assert torch.equal(mx[name], tensor), name


@pytest.mark.processes
def test_refit_check_reports_and_fails_on_a_mismatch(llama_dir, monkeypatch, capsys):
    from policyworker.generation import process
    from policyworker.tools import refit_check as check

    opts = check.CheckOptions(model=str(llama_dir), buffer_size_bytes=SMALL_BUFFER, refits=2)
    assert check.main(opts) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["ok"] and row["weights_equal"] and row["transport"] == "ipc"
    assert row["weight_version"] == row["trainer_weight_version"] == 2
    assert row["max_logprob_diff"] <= 1e-4 and row["names"] == 21 and row["bytes"] > 0
    # layout options: a TP2 trainer resharded into one destination rank
    reshard = check.CheckOptions(
        model=str(llama_dir), transport="reshard", trainer_tp=2, receiver_tp=1, refits=2
    )
    assert check.main(reshard) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["ok"] and row["weights_equal"] and row["weight_version"] == 2
    assert (row["trainer_tp"], row["receiver_tp"], row["names"]) == (2, 1, 21)
    # the receiver now sums differently from the trainer: the check must fail (the
    # collective transport's success is test_moe's `test_refit_check_on_an_moe_model`)
    monkeypatch.setattr(process, "tensor_sums", lambda t: (0.0, 0.0))
    collective = check.CheckOptions(model=str(llama_dir), transport="collective", refits=1)
    assert check.main(collective) == 1
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["transport"] == "collective" and row["weights_equal"] is False


@pytest.mark.processes
def test_refit_check_refuses_bad_options_before_starting(tmp_path):
    cmd = [sys.executable, "-m", "policyworker", "refit-check", "--model", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--model: no config.json" in proc.stderr
    from policyworker.tools.refit_check import CheckOptions

    with pytest.raises(ValueError, match="--receiver-tp"):
        CheckOptions(model=str(tmp_path), transport="ipc", receiver_tp=2)
    with pytest.raises(ValueError, match="--transport"):
        CheckOptions(model=str(tmp_path), transport="rdma")


def _collective_pair(worker, folder, info, timeout_s=30.0):
    """A generation process joined with the worker in a refit group of two."""
    from policyworker.parallel.dims import free_port

    port = free_port()
    gen = GenerationProcess(str(folder), info, timeout_s=timeout_s)
    gen.init_collective("127.0.0.1", port, 2, 1)
    worker.init_collective("127.0.0.1", port, 2)
    return gen


@pytest.mark.processes
def test_collective_refit_is_exact_and_versioned(llama_dir):
    refit = RefitConfig(checksum=True, timeout_s=30.0)
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-2), refit=refit)
    info = worker.prepare_refit_info()
    with _collective_pair(worker, llama_dir, info) as gen:
        for version in (1, 2):
            worker.train(make_batch(batch=4, seq=12), NLLLoss())
            gen.begin_refit_collective()
            report = worker.broadcast_weights_for_collective(buffer_size_bytes=SMALL_BUFFER)
            assert gen.end_refit() == report.version == worker.weight_version == version
            assert report.buckets > 1 and report.checksum
            got, sent = gen.weights(), dict(worker.export_hf_weights())
            assert all(torch.equal(got[n], sent[n]) for n in sent)


@pytest.mark.processes
def test_collective_refit_with_mismatched_info_fails_on_both_sides(llama_dir, tmp_path):
    worker = make_worker(llama_dir, refit=RefitConfig(timeout_s=30.0))
    other = make_hf_model(tmp_path, "llama", intermediate_size=128)
    with _collective_pair(worker, other, make_worker(other).prepare_refit_info()) as gen:
        before = gen.weights()
        gen.begin_refit_collective()
        with pytest.raises(RefitError, match="refit info differs"):
            worker.broadcast_weights_for_collective()
        with pytest.raises(RefitError, match="refit info differs"):
            gen.end_refit()
        assert all(torch.equal(before[n], t) for n, t in gen.weights().items())
    assert worker.weight_version == 0


@pytest.mark.processes
def test_a_dead_collective_receiver_fails_the_trainer_in_time(llama_dir):
    worker = make_worker(llama_dir, refit=RefitConfig(timeout_s=3.0))
    info = worker.prepare_refit_info()
    gen = _collective_pair(worker, llama_dir, info, timeout_s=3.0)
    kill(gen)
    start = time.monotonic()
    with pytest.raises(RefitError, match="the collective failed"):
        worker.broadcast_weights_for_collective(buffer_size_bytes=SMALL_BUFFER)
    assert time.monotonic() - start < 15
    gen.close()


@pytest.mark.processes
def test_a_timed_out_command_never_answers_the_next_one(llama_dir):
    """Each command's answer carries its id: a late answer (to a command that timed out) is
    dropped, and the engine stays usable; a second begin_refit is refused, not queued."""
    worker = make_worker(llama_dir)
    info = worker.prepare_refit_info()
    big, small = make_batch(batch=64, seq=60), make_batch(batch=2, seq=12, seed=1)
    with GenerationProcess(str(llama_dir), info) as gen:
        want = gen.logprobs(small["input_ids"], small["input_lengths"])
        gen.timeout_s = 1e-4
        with pytest.raises(EngineError, match="no answer to logprobs"):
            gen.logprobs(big["input_ids"], big["input_lengths"])
        gen.timeout_s = 60.0
        assert torch.equal(gen.logprobs(small["input_ids"], small["input_lengths"]), want)

        gen.begin_refit_ipc(worker.get_zmq_address(), timeout_s=1.0)  # no trainer streams
        with pytest.raises(EngineError, match="a refit is in progress"):
            gen.begin_refit_ipc(worker.get_zmq_address())
        gen.timeout_s = 1e-3
        with pytest.raises(EngineError, match="no answer to refit"):
            gen.end_refit()
        gen.timeout_s = 60.0
        assert gen.version() is None  # not the refit's late RefitError
        with pytest.raises(EngineError, match="no refit was begun"):
            gen.end_refit()
        gen.begin_refit_ipc(worker.get_zmq_address())
        worker.stream_weights_via_ipc_zmq()
        assert gen.end_refit() == 1 and gen.version() == 1

        def interrupt_once(method: str) -> None:  # a Ctrl-C at that point of the next call
            def hit(*args: object, **kwargs: object) -> None:
                delattr(gen._pipe.conn, method)
                raise KeyboardInterrupt

            setattr(gen._pipe.conn, method, hit)

        interrupt_once("poll")  # while waiting: its answer comes late and is dropped
        with pytest.raises(KeyboardInterrupt):
            gen.weights()
        assert gen.version() == 1
        interrupt_once("recv_bytes")  # while reading an answer: the pipe is out of step
        with pytest.raises(KeyboardInterrupt):
            gen.weights()
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"interrupted while reading .* out of step"):
            gen.logprobs(small["input_ids"], small["input_lengths"])
        assert time.monotonic() - start < 1  # at once, not after a timeout
