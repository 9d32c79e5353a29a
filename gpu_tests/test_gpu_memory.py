"""GPU checks of the memory phases and split-step training (run on the device, not in CI):
exact round trips through pinned host memory, an open step's gradients across an offload, what
an offload leaves on the GPU, and split-step = train() in bf16.

python -m pytest -q gpu_tests/test_gpu_memory.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import make_batch, make_hf_model
from test_gpu_parity import MEDIUM
from test_split_step import assert_same, snapshot

from policyworker.config import OptimizerConfig, PolicyConfig
from policyworker.losses import ClippedPGLoss, NLLLoss
from policyworker.worker import MegatronPolicyWorker

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("gpu_mem"), "llama", **MEDIUM)


def _worker(folder, distributed=False):
    return MegatronPolicyWorker(
        PolicyConfig(
            model_name=str(folder),
            precision="bfloat16",
            train_global_batch_size=4,
            train_micro_batch_size=2,
            logprob_batch_size=4,
            max_total_sequence_length=128,
            optimizer=OptimizerConfig(lr=1e-4, use_distributed_optimizer=distributed),
        )
    )


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed-optimizer"])
def test_round_trip_through_pinned_memory_is_exact(folder, distributed):
    worker, twin = _worker(folder, distributed), _worker(folder, distributed)
    data = make_batch(batch=4, seq=100, vocab=1024, seed=1)
    for w in (worker, twin):
        w.train(data, ClippedPGLoss())
    before = snapshot(worker)
    state = worker.memory_stats()["state_on_device_bytes"]
    allocated = torch.cuda.memory_allocated()  # the twin's state is on this GPU too
    worker.offload_before_refit()
    worker.offload_after_refit()
    arenas = [g.arena for g in worker.memory._groups.values() if g.arena is not None]
    assert arenas and all(a.pinned for a in arenas)
    assert allocated - torch.cuda.memory_allocated() >= 0.95 * state
    worker.prepare_for_lp_inference()
    worker.prepare_for_training()
    assert_same(snapshot(worker), before)
    assert worker.train(data, ClippedPGLoss()) == twin.train(data, ClippedPGLoss())
    assert_same(snapshot(worker), snapshot(twin))


def test_open_step_survives_offload_and_split_equals_train(folder):
    worker, twin = _worker(folder), _worker(folder)
    data = make_batch(batch=4, seq=100, vocab=1024, seed=2)
    worker.begin_train_step(NLLLoss())
    worker.train_microbatch(data.slice(0, 2))
    worker.offload_after_refit()
    worker.prepare_for_lp_inference()
    worker.get_logprobs(data=data)
    worker.prepare_for_training()
    worker.train_microbatch(data.slice(2, 4))
    assert worker.finish_train_step() == twin.train(data, NLLLoss())
    assert_same(snapshot(worker), snapshot(twin))


def _long_worker(folder: Path, seq: int, **options: object) -> MegatronPolicyWorker:
    """bf16, two sequences of up to `seq` tokens per step, one per micro-batch."""
    cfg = dict(
        model_name=str(folder),
        precision="bfloat16",
        train_global_batch_size=2,
        train_micro_batch_size=1,
        logprob_batch_size=1,
        max_total_sequence_length=seq,
    )
    return MegatronPolicyWorker(PolicyConfig(**cfg, **options))  # type: ignore[arg-type]


def test_full_recompute_lowers_the_peak_of_a_long_step_and_keeps_the_loss(tmp_path):
    """bf16, one 4k-token sequence per micro-batch: the activation peak of a train step (above
    what the worker holds between steps) with full recompute is at most half of the one
    without; the loss stays within bf16 rounding. Prints both peaks."""
    from policyworker.config import RecomputeConfig

    folder = make_hf_model(
        tmp_path / "long", "llama", **(MEDIUM | {"max_position_embeddings": 4096})
    )
    data = make_batch(batch=2, seq=4096, vocab=1024, seed=3)
    peaks, metrics = {}, {}
    for on in (False, True):
        worker = _long_worker(folder, 4096, recompute=RecomputeConfig(activation_checkpointing=on))
        worker.train(data, NLLLoss())  # the optimizer state exists from here on
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        metrics[on] = worker.train(data, NLLLoss())
        peaks[on] = torch.cuda.max_memory_allocated() - base
        worker.shutdown()
    print(
        f"activation peak: {peaks[False] / 2**20:.0f} MiB without, {peaks[True] / 2**20:.0f} MiB with"
    )
    assert peaks[True] <= 0.5 * peaks[False]
    assert metrics[True]["loss"] == pytest.approx(metrics[False]["loss"], rel=2e-2)


def test_chunked_logits_lower_the_peak_by_the_logits_and_keep_the_numbers(tmp_path):
    """bf16, a 32k-token vocabulary, one 4k-token sequence per micro-batch: with
    `logprob_chunk_size=512` the step's peak (above what the worker holds between steps) drops
    by at least the bf16 logits of a micro-batch, get_logprobs' by at least half of them; loss and
    logprobs stay within bf16 rounding. Prints the peaks."""
    vocab, seq = 32768, 4096
    shape = MEDIUM | {"max_position_embeddings": seq, "vocab_size": vocab}
    folder = make_hf_model(tmp_path / "wide", "llama", **shape)
    data = make_batch(batch=2, seq=seq, vocab=vocab, seed=3)
    peaks: dict = {}
    metrics: dict = {}
    logprobs: dict = {}
    for chunk in (None, 512):
        worker = _long_worker(folder, seq, logprob_chunk_size=chunk)
        worker.train(data, NLLLoss())  # the optimizer state exists from here on
        peaks[chunk] = {}
        for name in ("train", "logprobs"):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if name == "train":
                metrics[chunk] = worker.train(data, NLLLoss())
            else:
                logprobs[chunk] = worker.get_logprobs(data=data)["logprobs"]
            peaks[chunk][name] = torch.cuda.max_memory_allocated() - base
        worker.shutdown()
    logits = seq * vocab * 2  # one micro-batch's bf16 logits
    print({c: {k: v / 2**20 for k, v in p.items()} for c, p in peaks.items()}, "MiB")
    assert peaks[512]["train"] <= peaks[None]["train"] - logits
    assert peaks[512]["logprobs"] <= peaks[None]["logprobs"] - logits // 2
    assert metrics[512]["loss"] == pytest.approx(metrics[None]["loss"], rel=2e-2)
    assert (logprobs[512] - logprobs[None]).abs().mean().item() <= 2e-2
