"""Remote sparse-delta refit (#30, part 1): the codec, the trainer's sharded baseline and its
commit, a TCP receiver in a generation process that applies whole versions only, and faults."""

from __future__ import annotations

import json

import pytest
import torch
import zmq
from conftest import make_worker
from helpers import make_batch
from refit_peers import kill

from policyworker.config import OptimizerConfig
from policyworker.generation.process import EngineError, GenerationProcess
from policyworker.losses import NLLLoss
from policyworker.refit.layout import RefitError
from policyworker.refit.sparse import KEY_ENV, Shard, stream, take_baseline
from policyworker.refit.sparse_codec import PayloadError, apply_delta, decode, delta, encode
from policyworker.refit.sparse_link import signed
from policyworker.refit.sparse_receiver import SparseReceiver

pytestmark = pytest.mark.processes

KEY = "a test run's key"


@pytest.fixture(autouse=True)
def _run_key(monkeypatch):
    """The trainers read the run's key from `KEY_ENV`; the engines are bound with it."""
    monkeypatch.setenv(KEY_ENV, KEY)


def test_codec_is_bit_exact_and_catches_corruption():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 96, generator=g).bfloat16()
    new = base.clone()
    new[1, 2] = -0.0 if base[1, 2] == 0 else base[1, 2] + 1
    new[5] = float("nan")
    new[7, 0] = 0.0
    base[7, 0] = -0.0  # equal as floats, different bits: sent
    d = delta("w", new, base)
    assert d.index.dtype == torch.int32 and d.changed == d.index.numel() == 1 + 96 + 1
    same = delta("v", base, base)
    body, crc = encode([d, same])
    expected = {"w": ((64, 96), torch.bfloat16), "v": ((64, 96), torch.bfloat16)}
    got = decode(body, crc, expected)
    target = base.clone()
    apply_delta(target, got[0])
    apply_delta(target, got[0])  # absolute values: applying twice changes nothing
    assert torch.equal(target.view(torch.int16), new.view(torch.int16))
    assert got[1].index.numel() == 0
    moved = delta("m", base + 1, base)  # every element: sent dense, the values alone
    assert moved.index is None and moved.changed == base.numel()
    dense = decode(*encode([moved]), {"m": ((64, 96), torch.bfloat16)})[0]
    target = base.clone()
    apply_delta(target, dense)
    assert torch.equal(target.view(torch.int16), (base + 1).view(torch.int16))
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 1
    with pytest.raises(PayloadError, match="checksum"):
        decode(bytes(flipped), crc, expected)
    bad = json.dumps([["w", [2], "bfloat16", 5, "int32"]]).encode()
    import zlib

    import zstandard

    short = zstandard.ZstdCompressor().compress(len(bad).to_bytes(4, "little") + bad + b"\0" * 6)
    with pytest.raises(PayloadError, match="does not decode"):
        decode(short, zlib.crc32(short), {"w": ((2,), torch.bfloat16)})


def _setup(llama_dir, lr):
    worker = make_worker(llama_dir, precision="bfloat16", optimizer=OptimizerConfig(lr=lr))
    info = worker.init_remote_sparse_delta_baseline(shard_rank=0, shard_count=1, transport="zmq")
    return worker, info


def _stream(worker, targets, transfer_id, **kw):
    args = dict(transfer_id=transfer_id, api_key_env_var=KEY_ENV, timeout_s=10.0, shard_rank=0,
                shard_count=1, overwrite_names=[]) | kw  # fmt: skip
    return worker.stream_remote_sparse_weights("zmq", targets, **args)


_THREADS = """
import sys, threading, torch
from policyworker.refit.sparse_codec import decode, delta, encode

base = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
errors = []

def work(k):
    try:
        for i in range(150):
            new = base.clone()
            new[(k + i) % 256] += 1
            d = delta(f"w{k}", new, base)
            got = decode(*encode([d]), {f"w{k}": ((256, 512), torch.float32)})[0]
            assert torch.equal(got.index, d.index) and torch.equal(got.values, d.values)
    except BaseException as e:
        errors.append(repr(e))

threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors[:2])
sys.exit(1 if errors else 0)
"""


def test_the_codec_is_safe_from_several_threads():
    """Eight threads encoding and decoding at once get exactly what they sent. With one zstd
    context shared by every thread, this corrupted payloads or crashed the interpreter in most
    runs (the subprocess keeps such a crash from taking the test session down)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _THREADS], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])


def test_refits_through_a_relay_tree_are_exact_and_sparse(llama_dir):
    """Two steps at lr 1e-6 and refits into three engines (the first relays to the other two):
    each bitwise equal to the trainer's export each time; the payloads left the trainer once,
    and the wire carried a fraction of a full refit."""
    worker, info = _setup(llama_dir, 1e-6)
    full_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
    data = make_batch(batch=4, seq=12)
    engines = [GenerationProcess(str(llama_dir), info) for _ in range(3)]
    try:
        targets = [e.bind_sparse(api_key=KEY) for e in engines]
        for version in (1, 2):
            worker.train(data, NLLLoss())
            for e in engines:
                e.begin_refit_sparse(f"t{version}", 1, tree=targets)
            stats = _stream(worker, targets, f"t{version}")
            assert [e.end_refit() for e in engines] == [version] * 3
            worker.finish_remote_sparse_delta_sync(succeeded=True)
            sent = dict(worker.export_hf_weights())
            for e in engines:
                got = e.weights()
                assert all(torch.equal(got[n], sent[n]) for n in sent)
            assert stats["total_elements"] == sum(t.numel() for t in sent.values())
            # most bf16 weights do not move by a bf16 step at lr 1e-6; one copy on the wire
            assert 0 < stats["changed_elements"] < 0.5 * stats["total_elements"]
            assert stats["wire_bytes"] < full_bytes / 4
    finally:
        for e in engines:
            e.close()


def test_a_refused_refit_changes_nothing_and_the_next_resends_it(llama_dir, monkeypatch):
    """A payload corrupted in transit: the receiver refuses it, the trainer raises, nothing is
    applied and the baseline stays; the next refit carries both steps' changes, exactly."""
    import policyworker.refit.sparse as sparse

    worker, info = _setup(llama_dir, 1e-3)
    data = make_batch(batch=4, seq=12)
    with GenerationProcess(str(llama_dir), info) as gen:
        target = gen.bind_sparse(api_key=KEY)
        assert gen.bind_sparse(api_key=KEY) == target  # the same settings: the same receiver
        for other in (dict(api_key="another key"), dict(api_key=KEY, host="0.0.0.0")):
            with pytest.raises(ValueError, match="bound already with another key or host") as e:
                gen.bind_sparse(**other)  # the engine's own error, its traceback the cause
            assert isinstance(e.value.__cause__, EngineError)
        before = gen.weights()
        worker.train(data, NLLLoss())
        real = sparse.encode
        monkeypatch.setattr(sparse, "encode", lambda ds: (real(ds)[0], real(ds)[1] ^ 1))
        gen.begin_refit_sparse("bad", 1)
        with pytest.raises(RefitError, match="checksum"):
            _stream(worker, [target], "bad")
        with pytest.raises(RefitError, match="checksum"):
            gen.end_refit()
        worker.finish_remote_sparse_delta_sync(succeeded=False)
        monkeypatch.setattr(sparse, "encode", real)
        after = gen.weights()
        assert all(torch.equal(before[n], after[n]) for n in before)
        worker.train(data, NLLLoss())
        gen.begin_refit_sparse("good", 1)
        _stream(worker, [target], "good")
        assert gen.end_refit() == 1
        worker.finish_remote_sparse_delta_sync(succeeded=True)
        got, sent = gen.weights(), dict(worker.export_hf_weights())
        assert all(torch.equal(got[n], sent[n]) for n in sent)


def test_a_restarted_receiver_refuses_a_delta_then_takes_a_full_resync(llama_dir):
    """An engine restarted from the HF weights while the trainer is at version 1: the delta
    against version 1 is refused by name, never applied to the wrong bits; a full resync then
    brings it to version 2, bitwise."""
    worker, info = _setup(llama_dir, 1e-3)
    data = make_batch(batch=4, seq=12)
    with GenerationProcess(str(llama_dir), info) as gen:
        worker.train(data, NLLLoss())
        target = gen.bind_sparse(api_key=KEY)
        gen.begin_refit_sparse("t1", 1)
        _stream(worker, [target], "t1")
        assert gen.end_refit() == 1
        worker.finish_remote_sparse_delta_sync(succeeded=True)
    with GenerationProcess(str(llama_dir), info) as fresh:  # at version 0 again
        before = fresh.weights()
        worker.train(data, NLLLoss())
        target = fresh.bind_sparse(api_key=KEY)
        fresh.begin_refit_sparse("t2", 1)
        with pytest.raises(RefitError, match="holds version 0"):
            _stream(worker, [target], "t2")
        with pytest.raises(RefitError, match="full resync first"):
            fresh.end_refit()
        worker.finish_remote_sparse_delta_sync(succeeded=False)
        after = fresh.weights()
        assert all(torch.equal(before[n], after[n]) for n in before)
        fresh.begin_refit_sparse("t3", 1)
        stats = _stream(worker, [target], "t3", full_resync=True)
        assert fresh.end_refit() == 2
        worker.finish_remote_sparse_delta_sync(succeeded=True)
        got, sent = fresh.weights(), dict(worker.export_hf_weights())
        assert all(torch.equal(got[n], sent[n]) for n in sent)
        assert stats["wire_bytes"] > 0


def _dealer(address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _signed(kind: bytes, meta: dict, *rest: bytes) -> list[bytes]:
    return signed(KEY.encode(), [kind, json.dumps(meta).encode(), *rest])


def _replies(sock, n: int) -> list[dict]:
    return [json.loads(sock.recv_multipart()[1]) for _ in range(n)]


def test_duplicates_are_applied_once_and_a_missing_payload_applies_nothing():
    """In-process receiver: a payload sent twice is acknowledged twice and staged once; a
    transfer whose DONE counts a payload that never came (dropped), or whose producer died
    before its DONE, ends at the deadline with nothing applied; a stale transfer's message is
    refused on its own and the transfer in progress completes."""
    live = {"w": torch.zeros(4, 32, dtype=torch.bfloat16)}
    info = {"w": ((4, 32), torch.bfloat16)}
    receiver = SparseReceiver(live, info, api_key=KEY)
    new = torch.ones(4, 32, dtype=torch.bfloat16)
    body, crc = encode([delta("w", new, live["w"])])
    meta = {"transfer": "t", "producer": 0, "payload": 0, "base_version": 0, "crc": crc}
    sock = _dealer(receiver.address)
    try:
        for _ in range(2):
            sock.send_multipart(_signed(b"DATA", meta, body))
        sock.send_multipart(_signed(b"DONE", meta | {"payloads": 1}))
        assert receiver.receive("t", 1, timeout_s=5) == 1
        assert [r["ok"] for r in _replies(sock, 3)] == [True] * 3
        assert torch.equal(live["w"], new)
        # version 1 -> a transfer that loses its second payload
        meta2 = meta | {"transfer": "u", "base_version": 1}
        sock.send_multipart(_signed(b"DATA", meta2, body))
        sock.send_multipart(_signed(b"DONE", meta2 | {"payloads": 2}))
        with pytest.raises(RefitError, match="incomplete"):
            receiver.receive("u", 1, timeout_s=0.5)
        assert receiver.version == 1 and torch.equal(live["w"], new)
        _replies(sock, 2)
        # a producer that dies after its first payload (its socket gone, no DONE)
        meta3 = meta2 | {"transfer": "w"}
        dying = _dealer(receiver.address)
        dying.send_multipart(_signed(b"DATA", meta3, body))
        dying.close(linger=-1)
        with pytest.raises(RefitError, match="incomplete"):
            receiver.receive("w", 1, timeout_s=0.5)
        assert receiver.version == 1 and torch.equal(live["w"], new)
        # a stale message (of transfer u) ahead of transfer v's: refused alone, v completes
        sock.send_multipart(_signed(b"DATA", meta2, body))
        meta4 = meta2 | {"transfer": "v"}
        sock.send_multipart(_signed(b"DATA", meta4, body))
        sock.send_multipart(_signed(b"DONE", meta4 | {"payloads": 1}))
        assert receiver.receive("v", 1, timeout_s=5) == 2
        stale, *rest = _replies(sock, 3)
        assert not stale["ok"] and "stale" in stale["error"] and all(r["ok"] for r in rest)
    finally:
        sock.close(linger=0)
        receiver.close()


def test_the_sender_thread_keeps_order_and_a_refusal_stops_it_in_time(monkeypatch):
    """One tensor per payload (12 payloads through the bounded pipeline of the sender thread):
    applied exactly. Then the third payload corrupted: the receiver refuses it, the producer
    raises in the caller's thread, the sender ends, nothing is applied."""
    import threading

    import policyworker.refit.sparse as sparse

    g = torch.Generator().manual_seed(0)
    names = [f"w{i}" for i in range(12)]
    live = {n: torch.zeros(8, 64, dtype=torch.bfloat16) for n in names}
    receiver = SparseReceiver(live, {n: ((8, 64), torch.bfloat16) for n in names}, api_key=KEY)
    source = take_baseline(((n, t.clone()) for n, t in live.items()), Shard(0, 1))

    def refit(transfer: str, new: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        got: dict[str, object] = {}

        def receive() -> None:
            try:
                got["version"] = receiver.receive(transfer, 1, timeout_s=5)
            except RefitError as e:
                got["error"] = e

        thread = threading.Thread(target=receive)
        thread.start()
        try:
            stats = stream(source, iter(new.items()), [receiver.address], transfer_id=transfer,
                           timeout_s=5, bucket_bytes=1, api_key=KEY)  # fmt: skip
        finally:
            thread.join()
        return stats, got

    try:
        new = {n: torch.randn(8, 64, generator=g).bfloat16() for n in names}
        stats, got = refit("a", new)
        assert stats["payloads"] == 12 and got == {"version": 1}
        assert all(torch.equal(live[n], new[n]) for n in names)
        sparse.finish(source, succeeded=True)
        real, calls = sparse.encode, []

        def corrupt_third(deltas):
            body, crc = real(deltas)
            calls.append(1)
            return body, crc ^ (len(calls) == 3)

        monkeypatch.setattr(sparse, "encode", corrupt_third)
        newer = {n: t + 1 for n, t in new.items()}
        with pytest.raises(RefitError, match="checksum"):
            refit("b", newer)
        assert len(calls) == 3  # the payloads queued after it were not sent
        assert all(torch.equal(live[n], new[n]) for n in names)
        assert not any(t.name == "sparse-refit-send" for t in threading.enumerate())
    finally:
        receiver.close()


def test_two_producers_each_send_their_share(llama_dir):
    """Ownership: tensor i belongs to producer i % 2; two producers' transfers complete one
    version together, and each tensor crossed once."""
    worker = make_worker(llama_dir, precision="bfloat16", optimizer=OptimizerConfig(lr=1e-3))
    info = worker.prepare_refit_info()
    export = lambda: iter(list(worker.export_hf_weights()))  # noqa: E731
    sources = [take_baseline(export(), Shard(r, 2)) for r in range(2)]
    assert set(sources[0].baseline).isdisjoint(sources[1].baseline)
    assert set(sources[0].baseline) | set(sources[1].baseline) == set(info)
    worker.train(make_batch(batch=4, seq=12), NLLLoss())
    live = {n: t.clone() for n, t in sources[0].baseline.items() | sources[1].baseline.items()}
    receiver = SparseReceiver(live, info, api_key=KEY)
    try:
        import threading

        # exported here, once: a producer is its own rank in a run, and two threads exporting
        # from one worker at once would run its (gloo) collectives concurrently
        exported = list(worker.export_hf_weights())
        stats = []
        threads = [
            threading.Thread(
                target=lambda s=s: stats.append(
                    stream(
                        s,
                        iter(exported),
                        [receiver.address],
                        transfer_id="t",
                        timeout_s=10,
                        api_key=KEY,
                    )
                )
            )
            for s in sources
        ]
        for t in threads:
            t.start()
        assert receiver.receive("t", 2, timeout_s=10) == 1
        for t in threads:
            t.join()
    finally:
        receiver.close()
    sent = dict(worker.export_hf_weights())
    assert all(torch.equal(live[n], sent[n]) for n in sent)
    assert sum(s["total_elements"] for s in stats) == sum(t.numel() for t in sent.values())


def test_bad_calls_are_refused(llama_dir, monkeypatch):
    worker = make_worker(llama_dir)
    with pytest.raises(ValueError, match="init_remote_sparse_delta_baseline"):
        _stream(worker, ["tcp://127.0.0.1:1"], "t")
    for kw, match in [
        (dict(shard_rank=2, shard_count=2, transport="zmq"), "shard_rank"),
        (dict(shard_rank=0, shard_count=0, transport="zmq"), "shard_count"),
        (dict(shard_rank=0, shard_count=1, transport="vllm_s3_sparse"), "transport"),
    ]:
        with pytest.raises(ValueError, match=match):
            worker.init_remote_sparse_delta_baseline(**kw)
    worker.init_remote_sparse_delta_baseline(shard_rank=0, shard_count=1, transport="zmq")
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    for targets, kw, match in [
        ([], {}, "targets"),
        (["http://x"], {}, "targets"),
        (["tcp://127.0.0.1:1"], dict(transfer_id=""), "transfer_id"),
        (["tcp://127.0.0.1:1"], dict(timeout_s=0), "timeout_s"),
        (["tcp://127.0.0.1:1"], dict(shard_count=2), "baseline was taken"),
        (["tcp://127.0.0.1:1"], dict(overwrite_names=["nope"]), "overwrite_names"),
        (["tcp://127.0.0.1:1"], dict(api_key_env_var="NO_SUCH_KEY"), "api_key_env_var"),
        (["tcp://127.0.0.1:1"], dict(api_key_env_var=None), "api_key_env_var: the sparse"),
    ]:
        args = {"transfer_id": "t"} | kw
        with pytest.raises(ValueError, match=match):
            _stream(worker, targets, **args)


def test_a_dead_receiver_fails_the_trainer_in_time(llama_dir):
    """The relay tree's root dead: the trainer fails within its timeout. A leaf dead: its
    parent cannot pass a payload on, refuses it, and applies nothing either."""
    worker, info = _setup(llama_dir, 1e-3)
    root, leaf = GenerationProcess(str(llama_dir), info), GenerationProcess(str(llama_dir), info)
    try:
        targets = [root.bind_sparse(api_key=KEY), leaf.bind_sparse(api_key=KEY)]
        before = root.weights()
        kill(leaf)
        worker.train(make_batch(batch=4, seq=12), NLLLoss())
        root.begin_refit_sparse("t", 1, timeout_s=2.0, tree=targets)
        with pytest.raises(RefitError, match=targets[1].replace(".", r"\.")):
            _stream(worker, targets, "t", timeout_s=10.0)
        with pytest.raises(RefitError, match="no answer"):
            root.end_refit()
        worker.finish_remote_sparse_delta_sync(succeeded=False)
        after = root.weights()
        assert all(torch.equal(before[n], after[n]) for n in before)
        kill(root)
        with pytest.raises(RefitError, match="no answer"):
            _stream(worker, targets, "u", timeout_s=1.0)
    finally:
        root.close()
        leaf.close()


def test_a_trainer_killed_mid_transfer_leaves_every_engine_on_its_version(llama_dir, tmp_path):
    """A trainer process killed (SIGKILL) after its first payload reached the relay tree, before
    DONE: both engines end the refit at their deadline with nothing applied, no process or socket
    of it left; the next refit from a live trainer applies exactly."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from helpers import clean_env

    worker, info = _setup(llama_dir, 1e-3)  # the live trainer of the next refit
    engines = [GenerationProcess(str(llama_dir), info) for _ in range(2)]
    try:
        targets = [e.bind_sparse(api_key=KEY) for e in engines]
        before = engines[1].weights()
        script = Path(__file__).parent / "sparse_trainer.py"
        argv = [sys.executable, str(script), str(llama_dir), json.dumps(targets), str(tmp_path)]
        env = clean_env() | {KEY_ENV: KEY}
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)

        def wait_for(name: str) -> None:
            deadline = time.monotonic() + 120
            while not (tmp_path / name).exists() and proc.poll() is None:
                assert time.monotonic() < deadline, name
                time.sleep(0.05)
            assert (tmp_path / name).exists(), proc.stderr.read().decode()[-2000:]

        wait_for("ready")
        for e in engines:
            e.begin_refit_sparse("killed", 1, timeout_s=3.0, tree=targets)
        (tmp_path / "go").touch()
        wait_for("sent")
        proc.kill()
        proc.wait(timeout=10)
        start = time.monotonic()
        for e in engines:
            with pytest.raises(RefitError, match="incomplete"):
                e.end_refit()
        assert time.monotonic() - start < 10  # the receivers' deadline, not a hang
        for e in engines:
            after = e.weights()
            assert all(torch.equal(before[n], after[n]) for n in before)
        worker.train(make_batch(batch=4, seq=12), NLLLoss())
        for e in engines:
            e.begin_refit_sparse("next", 1, tree=targets)
        _stream(worker, targets, "next")
        assert [e.end_refit() for e in engines] == [1, 1]
        worker.finish_remote_sparse_delta_sync(succeeded=True)
        sent = dict(worker.export_hf_weights())
        for e in engines:
            got = e.weights()
            assert all(torch.equal(got[n], sent[n]) for n in sent)
    finally:
        for e in engines:
            e.close()


def test_refit_check_runs_the_sparse_transport(llama_dir):
    """`refit-check --transport sparse`: two trainer ranks (TP2, both producers) train a step
    before each refit; the engine ends bitwise equal, and the line reports the sparsity."""
    from policyworker.tools.refit_check import CheckOptions, run_check

    row = run_check(
        CheckOptions(model=str(llama_dir), transport="sparse", precision="bfloat16", trainer_tp=2)
    )
    assert row["ok"] and row["weights_equal"] and row["weight_version"] == 2
    assert 0 < row["changed_fraction"] < 0.5 and row["wire_bytes"] == row["bytes"] > 0
