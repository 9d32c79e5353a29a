"""The driver's local backend on a GPU (run on the device, not in CI): one worker process on the
GPU (NCCL) gives what a worker in this process gives; a worker killed mid-call fails the call at
once and leaves nothing behind. Ray cannot be installed on the GPU machine; it is tested on CPU.

python -m pytest -q gpu_tests/test_gpu_driver.py
"""

import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from driver_faults import FailingLoss
from helpers import make_batch, make_hf_model
from test_gpu_parity import MEDIUM

from policyworker import Policy, WorkerError
from policyworker.config import PolicyConfig
from policyworker.losses import ClippedPGLoss
from policyworker.worker import MegatronPolicyWorker

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)


def _config(folder: Path) -> PolicyConfig:
    return PolicyConfig(
        model_name=str(folder),
        precision="float32",
        train_global_batch_size=8,
        train_micro_batch_size=2,
        logprob_batch_size=4,
        max_total_sequence_length=128,
    )


def test_local_driver_on_the_gpu_equals_an_in_process_worker(tmp_path):
    folder = make_hf_model(tmp_path, "llama", **MEDIUM)
    data = make_batch(batch=8, seq=100, vocab=MEDIUM["vocab_size"])
    worker = MegatronPolicyWorker(_config(folder))
    want = [worker.get_logprobs(data=data)["logprobs"]]
    want_metrics = worker.train(data, ClippedPGLoss())
    want.append(worker.get_logprobs(data=data)["logprobs"])
    with Policy(_config(folder), num_workers=1) as policy:
        assert str(policy.device).startswith("cuda")
        got = [policy.get_logprobs(data=data)["logprobs"]]
        got_metrics = policy.train(data, ClippedPGLoss())
        got.append(policy.get_logprobs(data=data)["logprobs"])
        backend = policy.memory_stats()[0]["params_on"]
    assert backend == "device"
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.cpu(), atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5)


def test_a_killed_gpu_worker_fails_the_call_at_once(tmp_path):
    folder = make_hf_model(tmp_path, "llama", **MEDIUM)
    data = make_batch(batch=8, seq=100, vocab=MEDIUM["vocab_size"])
    policy = Policy(_config(folder), num_workers=1, failure_timeout_s=5)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 0 failed train"):
        policy.train(data, FailingLoss(rank=0, how="kill"))
    elapsed = time.monotonic() - start
    pids = policy.pids
    policy.shutdown()
    assert elapsed < 10, elapsed
    assert not [p for p in pids if psutil.pid_exists(p)]
