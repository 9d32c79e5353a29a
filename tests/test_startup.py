"""Start-up and exit: what the driver loads, megatron-core's deferred compiles, results' wire
format, and a worker process's quick exit that still runs every exit hook and leaves nothing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import clean_env, make_batch

from policyworker.compat.process import deferred
from policyworker.wire import pack, unpack

ROOT = Path(__file__).parent.parent


def _run(code: str) -> str:
    env = {**clean_env(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.processes
def test_a_driver_loads_neither_megatron_nor_transformers():
    out = _run(
        "import sys, policyworker.driver.policy, policyworker.generation.process, "
        "policyworker.tools.refit_check\n"
        "print(sorted(m for m in ('megatron', 'transformers', 'torch._dynamo') if m in sys.modules))"
    )
    assert out == "[]"


@pytest.mark.processes
def test_megatron_imports_without_compiling_and_compiles_on_first_use_with_cuda():
    out = _run(
        "import sys, torch, policyworker, policyworker.worker, policyworker.assembly\n"
        "import megatron.core.jit as jit\n"
        "print('torch._dynamo' in sys.modules, torch.compile.__module__)\n"
        "f = jit.jit_fuser(lambda x: x * 2)\n"
        "print('torch._dynamo' in sys.modules, f(torch.ones(2)).tolist())\n"
        "print('torch._dynamo' in sys.modules)"
    )
    compiled = str(torch.cuda.is_available())  # on a CPU-only machine it runs eagerly
    assert out.splitlines() == ["False torch", "False [2.0, 2.0]", compiled]


def test_a_deferred_function_compiles_once_with_its_options():
    calls = []

    def fake_compile(fn, **options):
        calls.append(options)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    class Holder:
        method = deferred(fake_compile, lambda self, x: x + 1, {"dynamic": True})

    f = deferred(fake_compile, lambda x: x * 3, {"mode": "max"})
    assert calls == []
    assert f(2) == ("compiled", 6) and f(3) == ("compiled", 9)
    assert Holder().method(1) == ("compiled", 2)  # binds as a method
    assert calls == [{"mode": "max"}, {"dynamic": True}]


@pytest.mark.processes
def test_exit_now_runs_every_exit_hook(tmp_path):
    mark = tmp_path / "hooks"
    _run(
        "import atexit, weakref\n"
        "from policyworker.compat.process import exit_now\n"
        f"atexit.register(lambda: open({str(mark)!r}, 'a').write('atexit '))\n"
        "class T: pass\n"
        "t = T()\n"
        f"weakref.finalize(t, lambda: open({str(mark)!r}, 'a').write('finalize '))\n"
        "print('bye', flush=True)\n"
        "exit_now()\n"
        "raise SystemExit('not reached')"
    )
    assert set(mark.read_text().split()) == {"atexit", "finalize"}


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5),
        torch.randn(4, 6).to(torch.bfloat16),
        torch.randn(5, 4).t(),  # not contiguous
        torch.tensor(7.5),  # 0-dim
        torch.zeros(0, 3),  # empty
        torch.tensor([True, False]),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
    ],
    ids=["fp32", "bf16", "transposed", "scalar", "empty", "bool", "int64"],
)
def test_results_cross_bit_exact(tensor):
    back = unpack(pack({"x": tensor, "rest": [tensor, 3, "s"]}))
    for got in (back["x"], back["rest"][0]):
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert back["rest"][1:] == [3, "s"]
    back["x"].zero_()  # a writable tensor of its own


def test_a_packed_result_names_no_megatron_module():
    assert "megatron.core" in sys.modules  # imported by conftest: it swaps torch's storage rebuild
    batch = make_batch(batch=2, seq=4)
    blob = pack(batch)
    assert b"megatron" not in blob
    assert torch.equal(unpack(blob)["input_ids"], batch["input_ids"])
    assert type(unpack(blob)) is type(batch)


@pytest.mark.processes
def test_a_worker_process_exits_at_once_and_leaves_nothing(llama_dir):
    import time

    from policyworker import Policy, PolicyConfig

    before = set(os.listdir("/dev/shm"))
    policy = Policy(PolicyConfig(model_name=str(llama_dir), precision="float32"), num_workers=1)
    policy.get_logprobs(make_batch(batch=2, seq=8))
    pid = policy.pids[0]
    start = time.perf_counter()
    policy.shutdown()
    assert time.perf_counter() - start < 1.0  # no second of interpreter teardown
    assert not Path(f"/proc/{pid}").exists()
    # what either process made (our refit buffers and torch's shared memory name their
    # creator's pid); other tests' processes may run beside this one (pytest-xdist)
    ours = re.compile(rf"(?<!\d)({pid}|{os.getpid()})(?!\d)")
    assert not [f for f in set(os.listdir("/dev/shm")) - before if ours.search(f)]


def test_a_result_the_driver_cannot_unpickle_is_that_ranks_error():
    import pickle

    from policyworker.driver.group import Answers
    from policyworker.rpc import Reply

    answers = Answers(call="get_logprobs", call_id=3, world_size=2, failure_timeout_s=1.0,
                      call_timeout_s=None)  # fmt: skip
    bad = pickle.dumps(1).replace(b"K", b"c")  # an opcode whose argument is not there
    answers.add(0, Reply(3, pack({"x": torch.ones(2)}), 0.1))
    answers.add(1, Reply(3, bad, 0.1))
    assert torch.equal(answers.values[0]["x"], torch.ones(2))
    assert 1 not in answers.values
    assert "does not unpickle in the driver" in answers.errors[1].traceback
    assert answers.pending == []
