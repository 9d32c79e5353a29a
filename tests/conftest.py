import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_hf_model

# megatron-core's import probes the machine in a subprocess: at collection, not inside a test
import policyworker.assembly  # noqa: F401
from policyworker.config import PolicyConfig
from policyworker.worker import MegatronPolicyWorker

logging.getLogger("megatron").setLevel(logging.ERROR)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker computes on one thread: two workers of torch's default
    (a thread per core) on two cores made the in-process tests slower than one process (79 s
    against 56 s for `-m "not processes"`; 47 s on one thread each). Children inherit it; the
    ones that set their own (torchrun launches, the driver's ranks) keep theirs."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("llama"), "llama")


def make_worker(folder: Path, **overrides: object) -> MegatronPolicyWorker:
    kw: dict[str, object] = dict(
        model_name=str(folder),
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=2,
        logprob_batch_size=2,
        max_total_sequence_length=64,
    )
    kw.update(overrides)
    return MegatronPolicyWorker(PolicyConfig(**kw))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _processes_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Keep the tiers honest: a test that starts a process (subprocess, spawn, torchrun, Ray)
    must be marked `processes` (`make test-fast` leaves those out)."""
    import multiprocessing.process
    import subprocess

    started: list[str] = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def popen(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        started.append("a subprocess")
        popen_init(self, *args, **kwargs)

    def start(self):  # type: ignore[no-untyped-def]
        started.append("a multiprocessing process")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    yield
    if started and request.node.get_closest_marker("processes") is None:
        pytest.fail(f"{request.node.name} started {started[0]}: mark it @pytest.mark.processes")


# Files whose tests start Ray clusters (and `ray stop --force` them) or check state of the whole
# machine (/dev/shm, shut-down time): under pytest-xdist (`make test`) they are one work unit,
# so no two of them run at once.
_MACHINE_WIDE = {"test_driver.py", "test_demo.py", "test_startup.py"}

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # plain pytest: no workers to schedule
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class _FileUnits(LoadScopeScheduling):
        """pytest-xdist's `loadscope` by file (a file's tests run in order in one worker, so a
        module fixture is built once), the machine-wide files one unit. xdist's `loadgroup`
        would do it with markers, but it renames node ids, which pytest 9 no longer allows."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "machine-wide" if Path(path).name in _MACHINE_WIDE else path

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> _FileUnits:
        return _FileUnits(config, log)
