"""Faults around the worker: a script that just ends, file systems that fill up, files that
killed processes leave behind."""

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import make_worker
from helpers import clean_env, torchrun

from policyworker.generation.process import GenerationProcess
from policyworker.refit import buffers

pytestmark = pytest.mark.processes

HERE = Path(__file__).parent


def test_a_script_that_just_ends_commits_its_async_save_and_exits_cleanly(llama_dir, tmp_path):
    """Under torchrun (CP2, packed): no finalize, no shutdown, no destroy_process_group; both
    ranks exit 0, the pending async save is committed and loads, nothing is left behind."""
    ckpt = tmp_path / "ckpt"
    torchrun(HERE / "exit_script.py", llama_dir, ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["optim", "weights"]  # no temporary dirs
    worker = make_worker(llama_dir, max_total_sequence_length=32)
    worker.load_checkpoint(ckpt / "weights", ckpt / "optim")
    assert worker.state.scheduler.num_steps == 1


def _can_mount() -> bool:
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"]
    return shutil.which("unshare") is not None and subprocess.run(probe).returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs root for a private mount namespace")
def test_full_disk_and_small_shared_memory_fail_cleanly(llama_dir, tmp_path):
    """A save into a full file system (and an HF export): `CheckpointSaveError` naming the
    directory and "no space", no temporary files and no folder made for it left; a save
    elsewhere then works. A refit with too little
    /dev/shm: `RefitError` naming /dev/shm and the bytes (no SIGBUS), on both IPC paths."""
    small, roomy = tmp_path / "small", tmp_path / "roomy"
    small.mkdir(), roomy.mkdir()
    script = f"{sys.executable} {HERE / 'small_fs.py'} {llama_dir} {small} {roomy}"
    mounts = (
        f"mount -t tmpfs -o size=64k tmpfs {small} && mount -t tmpfs -o size=32k tmpfs /dev/shm"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{mounts} && {script}"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in ("sync", "async", "hf"):
        assert out[case]["type"] == "CheckpointSaveError", out[case]
        message = out[case]["message"]
        assert f"{small}" in message and "no space left" in message, out[case]
        assert out[f"after_{case}"] == []  # nor the folders made for it
    assert out["roomy"]["type"] == "" and (roomy / "w" / "policyworker.json").is_file()
    for side in ("trainer_direct", "engine_direct", "trainer_buffers"):
        assert out[side]["type"] == "RefitError", out[side]
        assert "/dev/shm has no room for a shared buffer of" in out[side]["message"], side
    assert out["engine_buffers"]["type"] == "RefitError"  # the trainer never sent
    assert out["after_refit"] == []


def _dead_pid() -> int:
    proc = mp.get_context("spawn").Process(target=int)
    proc.start()
    proc.join()
    return proc.pid


def test_refit_files_are_removed_and_dead_processes_files_swept(llama_dir):
    """A refit leaves no endpoint file; files of a killed process are swept by the next
    trainer that starts; a shut down worker leaves nothing of its own."""
    dead = _dead_pid()
    leftovers = [
        Path(buffers._SHM_DIR) / f"policyworker-refit-{dead}-0123abcd",
        Path(tempfile.gettempdir()) / f"policyworker-refit-{dead}-0.sock",
    ]
    for path in leftovers:
        path.write_bytes(b"x")
    folder = Path(tempfile.gettempdir()) / f"policyworker-refit-{dead}-x1y2z3"  # an endpoint's
    folder.mkdir(mode=0o700)
    (folder / "rank0.sock").write_bytes(b"")
    leftovers.append(folder)
    worker = make_worker(llama_dir)
    assert not any(p.exists() for p in leftovers)
    info = worker.prepare_refit_info()
    for shared in (True, False):
        with GenerationProcess(str(llama_dir), info, shared_staging=shared) as gen:
            gen.begin_refit_ipc(worker.get_zmq_address())
            worker.stream_weights_via_ipc_zmq(buffer_size_bytes=8192)
            gen.end_refit()
    mine = f"policyworker-refit-{os.getpid()}-"
    assert not [f for f in os.listdir(buffers._SHM_DIR) if f.startswith(mine)]
    endpoint = Path(worker.get_zmq_address().removeprefix("ipc://"))
    assert not endpoint.exists() and endpoint.parent.is_dir()  # the private folder, in use
    from policyworker.refit import ipc

    users = ipc._Private.users  # other workers of this process may hold endpoints there too
    worker.shutdown()
    worker.shutdown()  # idempotent
    assert ipc._Private.users == users - 1
    assert endpoint.parent.exists() == bool(ipc._Private.users)  # gone with the last one
    if not ipc._Private.users:
        assert not [f for f in os.listdir(tempfile.gettempdir()) if f.startswith(mine)]


def test_benchmark_model_folders_go_at_exit_on_success_and_on_failure(tmp_path):
    """Every benchmark left its model folders (3-21 GB each) in the temporary directory."""
    bench = Path(__file__).parents[1] / "benchmarks"
    for fail in (False, True):
        script = (
            f"import sys; sys.path.insert(0, {str(bench)!r})\n"
            "from train_bench import temporary_folder\n"
            f"folder = temporary_folder('bench-test-', {str(tmp_path)!r})\n"
            "(folder / 'model.safetensors').write_bytes(b'x')\n"
            f"if {fail}: raise RuntimeError('the benchmark failed')\n"
        )
        run = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True)
        assert run.returncode == (1 if fail else 0), run.stderr[-2000:]
        assert list(tmp_path.iterdir()) == []


def test_a_killed_saves_temporary_folder_is_swept_by_the_next_save(llama_dir, tmp_path):
    """A save killed mid-write left `.weights.tmp-*` beside its target, which nothing swept.
    The next save into that folder removes those of dead processes of this host; a live
    process's, another host's and anything else stay."""
    import socket

    from conftest import make_worker

    host, dead = socket.gethostname(), _dead_pid()
    killed = tmp_path / f".weights.tmp-{dead}@{host}-abcd1234"
    live = tmp_path / f".weights.tmp-{os.getpid()}@{host}-efgh5678"
    other_host = tmp_path / f".weights.tmp-{dead}@another-host-ijkl9012"
    mine = tmp_path / ".notes"
    for folder in (killed, live, other_host, mine):
        folder.mkdir()
    make_worker(llama_dir).save_checkpoint(tmp_path / "weights")
    assert not killed.exists() and live.exists() and other_host.exists() and mine.exists()
    assert (tmp_path / "weights" / "policyworker.json").is_file()
