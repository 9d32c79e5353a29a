"""Memory phases: the state machine in every order, exact round trips (weights, an open step's
gradients, optimizer state, scheduler), training after cycles, host memory over 20 cycles, the
calls a phase forbids, move_model / move_optimizer, and the telemetry."""

import itertools
import logging

import pytest
import torch
from conftest import make_worker
from helpers import make_batch
from test_split_step import assert_same, snapshot

from policyworker.config import OptimizerConfig
from policyworker.losses import ClippedPGLoss, NLLLoss
from policyworker.memory.phases import PHASES
from policyworker.memory.residency import PhaseError, Where

PHASE_CALLS = {
    "prepare_for_lp_inference": lambda w: w.prepare_for_lp_inference(),
    "prepare_for_lp_inference(keep_train_buffers)": lambda w: w.prepare_for_lp_inference(True),
    "prepare_for_training": lambda w: w.prepare_for_training(),
    "finish_inference": lambda w: w.finish_inference(),
    "offload_before_refit": lambda w: w.offload_before_refit(),
    "offload_after_refit": lambda w: w.offload_after_refit(),
    "pause_train_step_with_offloading": lambda w: w.pause_train_step_with_offloading(),
}


def trained_worker(llama_dir, **kw):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3), **kw)
    worker.train(make_batch(batch=4, seq=12, seed=1), ClippedPGLoss())  # optimizer state exists
    return worker


def expected(name: str, step_open: bool) -> dict[str, Where]:
    return {k: Where(v) for k, v in PHASES[name].targets(step_open).items()}


def test_every_phase_after_every_other_lands_on_its_placement(llama_dir):
    """All 49 ordered pairs, then training: the same step as a worker that never moved."""
    worker, twin = trained_worker(llama_dir), trained_worker(llama_dir)
    for first, second in itertools.product(PHASE_CALLS, repeat=2):
        PHASE_CALLS[first](worker)
        PHASE_CALLS[second](worker)
        assert worker.memory.where() == expected(second, step_open=False), (first, second)
        PHASE_CALLS[second](worker)  # idempotent
        assert worker.memory.where() == expected(second, step_open=False)
    worker.prepare_for_training()
    assert_same(snapshot(worker), snapshot(twin))
    data = make_batch(batch=4, seq=12, seed=2)
    assert worker.train(data, ClippedPGLoss()) == twin.train(data, ClippedPGLoss())
    assert_same(snapshot(worker), snapshot(twin))


@pytest.mark.parametrize(
    "precision,distributed",
    [("float32", False), ("bfloat16", False), ("bfloat16", True)],
    ids=["fp32", "bf16-masters", "bf16-distributed-optimizer"],
)
def test_offload_round_trip_is_exact_and_training_after_it_is_unchanged(
    llama_dir, precision, distributed
):
    kw = dict(precision=precision)
    opt = OptimizerConfig(lr=1e-3, use_distributed_optimizer=distributed)
    worker = make_worker(llama_dir, optimizer=opt, **kw)
    twin = make_worker(llama_dir, optimizer=opt, **kw)
    data = make_batch(batch=4, seq=12, seed=3)
    for _ in range(2):
        before = snapshot(worker)
        worker.offload_before_refit()
        worker.offload_after_refit()
        placed = worker.memory_stats()
        assert placed["state_on_device_bytes"] == 0 and placed["state_on_host_bytes"] > 0
        freed = [*worker.state.model.parameters(), *worker.state.ddp.buffers[0].params]
        freed += [b.grad_data for b in worker.state.ddp.buffers]
        freed += [p for g in worker.state.optimizer.optimizer.param_groups for p in g["params"]]
        assert all(t.untyped_storage().nbytes() == 0 for t in freed)
        worker.prepare_for_lp_inference()
        worker.prepare_for_training()
        assert_same(snapshot(worker), before)
        assert worker.train(data, ClippedPGLoss()) == twin.train(data, ClippedPGLoss())
    assert_same(snapshot(worker), snapshot(twin))


@pytest.mark.parametrize(
    "phase", ["offload_after_refit", "pause_train_step_with_offloading", "prepare_for_lp_inference"]
)
def test_an_open_steps_gradients_survive_a_phase(llama_dir, phase):
    """Stream a step around an offload (the colocated loop's detour to inference): the step
    equals one that never left the device, bit for bit."""
    worker, twin = trained_worker(llama_dir), trained_worker(llama_dir)
    data = make_batch(batch=4, seq=12, seed=4)
    worker.begin_train_step(NLLLoss())
    worker.train_microbatch(data.slice(0, 2))
    grads = [b.grad_data.clone() for b in worker.state.ddp.buffers]
    PHASE_CALLS[phase](worker)
    assert worker.memory.where()["grads"] is not Where.FREED
    worker.prepare_for_lp_inference()
    worker.get_logprobs(data=data)
    worker.prepare_for_training()
    buffers = worker.state.ddp.buffers
    assert all(torch.equal(a, b.grad_data) for a, b in zip(grads, buffers, strict=True))
    worker.train_microbatch(data.slice(2, 4))
    assert worker.finish_train_step() == twin.train(data, NLLLoss())
    assert_same(snapshot(worker), snapshot(twin))


def test_an_offloaded_step_can_be_aborted(llama_dir):
    worker = trained_worker(llama_dir)
    before = snapshot(worker)
    worker.begin_train_step(NLLLoss())
    worker.train_microbatch(make_batch(batch=2, seq=12))
    worker.offload_after_refit()  # the step's gradients go to the host
    worker.abort_train_step()
    assert worker.memory.where()["grads"] is Where.FREED
    worker.prepare_for_training()
    assert_same(snapshot(worker), before)


def test_calls_that_need_offloaded_state_raise_and_change_nothing(llama_dir, tmp_path):
    worker = trained_worker(llama_dir)
    data = make_batch(batch=4, seq=12)
    worker.offload_after_refit()
    for call in (
        lambda: worker.get_logprobs(data=data),
        lambda: worker.get_topk_logits(data=data, k=2),
        lambda: worker.get_reference_policy_logprobs(data=data),
        lambda: worker.train(data, NLLLoss()),
        lambda: worker.begin_train_step(NLLLoss()),
        worker.export_hf_weights,
    ):
        with pytest.raises(PhaseError, match="not on the device"):
            call()
    worker.offload_before_refit()  # params back, optimizer stays on the host
    list(worker.export_hf_weights())  # a refit reads the params
    with pytest.raises(PhaseError, match="grads and optimizer are not on the device"):
        worker.train(data, NLLLoss())
    worker.prepare_for_lp_inference()
    worker.get_logprobs(data=data)
    worker.train(data, NLLLoss(), eval_mode=True)  # evaluation needs only the params
    # the advice is one that helps: prepare_for_lp_inference() leaves the optimizer away
    with pytest.raises(PhaseError, match=r"optimizer .* call prepare_for_training\(\)") as e:
        worker.save_checkpoint(tmp_path / "w", tmp_path / "o")
    assert "call prepare_for_lp_inference()" not in str(e.value)
    worker.prepare_for_training()
    worker.save_checkpoint(tmp_path / "w", tmp_path / "o")


def test_move_model_and_move_optimizer(llama_dir):
    worker = trained_worker(llama_dir)
    before = snapshot(worker)
    model = worker.move_model(worker.state.model, "cpu")
    assert model is worker.state.model
    worker.move_optimizer("cpu")
    assert worker.memory.where() == {"params": "host", "grads": "freed", "optimizer": "host"}
    worker.move_model(worker.state.model, "cuda", move_grads=False)
    assert worker.memory.where()["grads"] is Where.FREED
    worker.move_model(worker.state.model, "cuda")
    worker.move_optimizer("cuda")
    assert_same(snapshot(worker), before)
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda'"):
        worker.move_optimizer("tpu")
    with pytest.raises(ValueError, match="model: expected this worker's model"):
        worker.move_model(torch.nn.Linear(2, 2), "cpu")


def test_twenty_cycles_reuse_one_host_buffer_and_grow_no_memory(llama_dir):
    worker = trained_worker(llama_dir, precision="bfloat16")
    data = make_batch(batch=4, seq=12)
    arenas, resident = [], []
    for _ in range(20):
        worker.prepare_for_lp_inference()
        worker.get_logprobs(data=data)
        worker.prepare_for_training()
        worker.train(data, NLLLoss())
        worker.offload_before_refit()
        worker.offload_after_refit()
        arenas.append([id(g.arena) for g in worker.memory._groups.values()])
        resident.append(worker.memory_stats()["device_used_bytes"])
    assert all(a == arenas[0] for a in arenas)  # allocated once, reused
    state = worker.memory_stats()["state_on_host_bytes"]
    assert worker.memory_stats()["host_buffer_bytes"] <= state + 512 * 64  # exact, not 2^k
    assert resident[-1] - resident[0] <= max(4 << 20, state // 10)


def test_phases_log_a_memory_line_at_debug_only(llama_dir, caplog):
    worker = trained_worker(llama_dir)
    name = "policyworker.memory.telemetry"
    with caplog.at_level(logging.INFO, logger=name):
        worker.offload_after_refit()
    assert not [r for r in caplog.records if r.name == name]
    with caplog.at_level(logging.DEBUG, logger=name):
        worker.prepare_for_training()
    (line,) = [r.getMessage() for r in caplog.records if r.name == name]
    assert line.startswith("memory after prepare_for_training: allocated")
    assert "params device, grads device, optimizer device" in line
    stats = worker.memory_stats()
    assert stats["state_on_host_bytes"] == 0 and stats["state_on_device_bytes"] > 0
