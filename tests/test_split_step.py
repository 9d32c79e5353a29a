"""Split-step training: begin / train_microbatch / finish / abort against train(), out-of-order
calls, errors inside a chunk."""

import pytest
import torch
from conftest import make_worker
from helpers import make_batch
from test_train_losses import LOSSES

from policyworker import BatchValidationError
from policyworker.config import OptimizerConfig, SequencePackingConfig
from policyworker.losses import ClippedPGConfig, ClippedPGLoss, NLLLoss

SPLITTABLE = {name: loss for name, loss in LOSSES.items() if loss.normalizer is not None}


def step_grads(ddp) -> list[torch.Tensor]:
    """The gradients a step would reduce: each `main_grad`, zero where no backward of the open
    step (or none is open) has reached it yet (FirstTouchDDP leaves an earlier step's values
    there until the first gradient overwrites them)."""
    return [
        torch.zeros_like(p.main_grad) if p in ddp.untouched else p.main_grad.clone()
        for p in ddp.params_with_grad
    ]


def snapshot(worker) -> dict[str, object]:
    """Everything a step may touch: weights, optimizer state, scheduler, grad buffers, hooks."""
    opt = worker.state.optimizer
    return {
        "params": {n: p.detach().clone() for n, p in worker.state.model.named_parameters()},
        "optimizer": [
            {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
            for part in getattr(opt, "chained_optimizers", [opt])
            for s in part.optimizer.state.values()
        ],
        "scheduler": worker.state.scheduler.state_dict(),
        "grads": step_grads(worker.state.ddp),
        "owner": id(worker),
        "hooks": [
            getattr(worker.state.model.config, k)
            for k in ("finalize_model_grads_func", "no_sync_func", "grad_sync_func")
        ],
    }


def assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert len(a["optimizer"]) == len(b["optimizer"])
    for sa, sb in zip(a["optimizer"], b["optimizer"], strict=True):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a["scheduler"] == b["scheduler"]
    assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True))
    if a["owner"] == b["owner"]:  # megatron's hooks are the worker's own bound methods
        assert a["hooks"] == b["hooks"]


def split_train(worker, data, loss_fn, chunk: int, mbs: int | None = None) -> dict:
    worker.begin_train_step(loss_fn, mbs=mbs)
    for start in range(0, data.size, chunk):
        worker.train_microbatch(data.slice(start, start + chunk))
    return worker.finish_train_step()


@pytest.mark.parametrize("name", SPLITTABLE)
def test_split_step_equals_train_bitwise(llama_dir, name):
    """Chunks that are whole micro-batches reduce in train()'s order: equal bit for bit."""
    loss_fn = LOSSES[name]
    batches = [make_batch(batch=4, seq=14, seed=s) for s in (3, 4)]
    whole = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3))
    split = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3))
    for data in batches:
        want = whole.train(data, loss_fn)
        got = split_train(split, data, loss_fn, chunk=2)
        assert got == want
    assert_same(snapshot(split), snapshot(whole))


def test_split_step_with_packing_is_within_1e_6(llama_dir):
    """Packed chunks make other bins than the whole batch: a different reduction order."""
    packing = SequencePackingConfig(enabled=True, train_mb_tokens=32)
    data = make_batch(batch=8, seq=14, seed=5)
    loss_fn = ClippedPGLoss(ClippedPGConfig(reference_policy_kl_penalty=0.1))
    # lr 1e-4: Adam turns ~1e-7 relative gradient noise into at most ~1% of an update
    kw = dict(optimizer=OptimizerConfig(lr=1e-4), sequence_packing=packing)
    kw |= dict(train_global_batch_size=8, max_grad_norm=0.0)
    whole, split = make_worker(llama_dir, **kw), make_worker(llama_dir, **kw)
    want = whole.train(data, loss_fn)
    got = split_train(split, data, loss_fn, chunk=2)
    for key, value in want.items():
        if key not in ("num_microbatches", "all_mb_metrics"):  # both depend on the cut
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    for (n, a), (_, b) in zip(
        whole.state.model.named_parameters(), split.state.model.named_parameters(), strict=True
    ):
        assert (a - b).abs().max() <= 1e-6, n


def test_a_loss_with_several_normalizers_is_refused_by_split_step_only(llama_dir):
    worker = make_worker(llama_dir)
    loss_fn = ClippedPGLoss(ClippedPGConfig(positive_example_nll_weight=0.2))
    before = snapshot(worker)
    with pytest.raises(ValueError, match="loss_fn: ClippedPGLoss divides its terms"):
        worker.begin_train_step(loss_fn)
    assert_same(snapshot(worker), before)
    worker.train(make_batch(batch=4, seq=12), loss_fn)  # train() knows the counts up front


def test_abort_leaves_everything_as_before(llama_dir):
    data = make_batch(batch=4, seq=12, seed=1)
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3))
    twin = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3))
    for w in (worker, twin):
        w.train(data, NLLLoss())  # optimizer state exists
    before = snapshot(worker)
    worker.begin_train_step(ClippedPGLoss())
    worker.train_microbatch(make_batch(batch=2, seq=12, seed=9))
    assert any(b.grad_data.abs().sum() > 0 for b in worker.state.ddp.buffers)
    worker.abort_train_step()
    assert_same(snapshot(worker), before)
    # and the next step is the step it would have been without the aborted one
    assert worker.train(data, NLLLoss()) == twin.train(data, NLLLoss())
    assert_same(snapshot(worker), snapshot(twin))


def test_calls_out_of_order_raise_and_change_nothing(llama_dir):
    worker = make_worker(llama_dir)
    data = make_batch(batch=4, seq=12)
    for call in (
        lambda: worker.train_microbatch(data),
        worker.finish_train_step,
        worker.abort_train_step,
    ):
        with pytest.raises(ValueError, match="no train step is open"):
            call()
    worker.begin_train_step(NLLLoss())
    worker.train_microbatch(data.slice(0, 2))
    open_state = snapshot(worker)
    bad_calls = {
        "a train step is open": [
            lambda: worker.begin_train_step(NLLLoss()),
            lambda: worker.train(data, NLLLoss()),
        ],
        "rows left": [
            lambda: worker.train_microbatch(data),  # 4 rows, 2 left
            lambda: worker.train_microbatch(data.slice(0, 1)),  # not a multiple of mbs=2
        ],
        "holds 2 of this rank's 4 rows": [worker.finish_train_step],
    }
    for message, calls in bad_calls.items():
        for call in calls:
            with pytest.raises(ValueError, match=message):
                call()
            assert_same(snapshot(worker), open_state)
    missing = data.slice(2, 4)
    del missing["token_mask"]
    with pytest.raises(BatchValidationError, match="token_mask"):
        worker.train_microbatch(missing)
    assert_same(snapshot(worker), open_state)
    worker.train_microbatch(data.slice(2, 4))  # the step is still usable
    assert worker.finish_train_step()["num_microbatches"] == 2


class _Boom(NLLLoss):
    def __call__(self, inputs, data, counts):
        raise RuntimeError("boom")


def test_an_error_inside_a_chunk_aborts_the_step(llama_dir):
    worker = make_worker(llama_dir)
    worker.train(make_batch(batch=4, seq=12), NLLLoss())
    before = snapshot(worker)
    worker.begin_train_step(_Boom())
    with pytest.raises(RuntimeError, match="boom") as err:
        worker.train_microbatch(make_batch(batch=2, seq=12))
    assert any("aborted" in note for note in err.value.__notes__)
    assert_same(snapshot(worker), before)
    with pytest.raises(ValueError, match="no train step is open"):
        worker.finish_train_step()
    worker.train(make_batch(batch=4, seq=12), NLLLoss())  # and training goes on
