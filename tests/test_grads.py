"""train/grads: first-touch gradient accumulation equals megatron's zero-then-add, bitwise."""

from __future__ import annotations

import pytest
import torch
from conftest import make_worker
from helpers import make_batch
from megatron.core.distributed import DistributedDataParallel

from policyworker.config import OptimizerConfig
from policyworker.losses import NLLLoss
from policyworker.train import optimizer as optimizer_module


class ZeroThenAddDDP(DistributedDataParallel):
    """megatron's own DDP (fills its buffers with zeros between steps, adds every gradient)."""

    def zero_untouched(self) -> None:
        pass


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_steps_equal_megatrons_ddp_with_stale_buffers(llama_dir, monkeypatch, precision):
    """Two micro-batches a step (a copy, then an add), three steps, and between steps the
    buffers of ours hold NaN: a gradient added to a stale value instead of written over it
    would poison the step. Losses, grad norms and weights equal megatron's DDP bitwise."""
    data = make_batch(batch=4, seq=12, seed=2)
    opt = OptimizerConfig(lr=1e-3)
    ours = make_worker(llama_dir, precision=precision, optimizer=opt)
    monkeypatch.setattr(optimizer_module, "FirstTouchDDP", ZeroThenAddDDP)
    theirs = make_worker(llama_dir, precision=precision, optimizer=opt)
    assert type(theirs.state.ddp) is ZeroThenAddDDP
    for _ in range(3):
        for buffer in ours.state.ddp.buffers:
            buffer.grad_data.fill_(float("nan"))
        a, b = ours.train(data, NLLLoss()), theirs.train(data, NLLLoss())
        assert a["num_microbatches"] == 2 and a["grad_norm"] > 0
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    mine, megatrons = dict(ours.export_hf_weights()), dict(theirs.export_hf_weights())
    assert all(torch.equal(mine[k], megatrons[k]) for k in megatrons)


def test_gradients_no_backward_reached_are_zeroed(llama_dir):
    """`zero_untouched` zeroes the stale `main_grad` of every parameter the step's backward
    did not reach and leaves the others as they are."""
    worker = make_worker(llama_dir)
    ddp = worker.state.ddp
    for buffer in ddp.buffers:
        buffer.grad_data.fill_(5.0)  # an earlier step's gradients
    ddp.zero_grad_buffer()
    reached, *others = ddp.params_with_grad
    ddp.untouched.discard(reached)  # as the backward hook does after writing it
    ddp.zero_untouched()
    assert not ddp.untouched
    assert bool((reached.main_grad == 5.0).all())
    assert all(bool((p.main_grad == 0).all()) for p in others)
