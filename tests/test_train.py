"""train(): invariance to micro-batch size, eval mode, learning, reference swap, NaN skip."""

import itertools
import math

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import hf_logprobs, make_batch

from policyworker.config import OptimizerConfig, SchedulerConfig
from policyworker.losses import ClippedPGConfig, ClippedPGLoss, NLLLoss
from policyworker.train.optimizer import grad_buffers


def _params(worker):
    return {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}


def _opt_state(worker):
    return {
        id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
        for p, s in worker.state.optimizer.optimizer.state.items()
    }


@pytest.mark.parametrize(
    "loss_fn",
    [NLLLoss(), ClippedPGLoss(), ClippedPGLoss(ClippedPGConfig(token_level_loss=False))],
    ids=["nll", "grpo", "grpo-seq"],
)
def test_mbs1_equals_mbs_gbs(llama_dir, loss_fn):
    data = make_batch(batch=4, seq=14, seed=3)
    results = []
    for mbs in (1, 4):
        worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3), max_grad_norm=0.0)
        results.append((worker.train(data, loss_fn, mbs=mbs), _params(worker)))
    (m1, p1), (m4, p4) = results
    assert m1["num_microbatches"] == 4 and m4["num_microbatches"] == 1
    assert m1["loss"] == pytest.approx(m4["loss"], rel=1e-5)
    assert m1["grad_norm"] == pytest.approx(m4["grad_norm"], rel=1e-5)
    assert m1["grad_norm"] > 0
    for name in p1:
        # Adam turns ~1e-7 gradient noise into at most ~1% of one lr-sized update.
        assert (p1[name] - p4[name]).abs().max() <= 1e-5, name


def test_eval_mode_changes_nothing(llama_dir):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3))
    data = make_batch(batch=4, seq=12)
    worker.train(data, NLLLoss())  # create optimizer state
    before, opt_before = _params(worker), _opt_state(worker)
    sched_before = worker.state.scheduler.num_steps
    train_loss = worker.train(data, NLLLoss(), eval_mode=True)["loss"]
    after, opt_after = _params(worker), _opt_state(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert opt_before.keys() == opt_after.keys()
    for k in opt_before:
        assert all(torch.equal(opt_before[k][s], opt_after[k][s]) for s in opt_before[k])
    assert worker.state.scheduler.num_steps == sched_before
    # eval loss is the loss a train step would report on the same weights
    assert worker.train(data, NLLLoss())["loss"] == pytest.approx(train_loss, rel=1e-6)


def test_repeated_nll_steps_drive_loss_down(llama_dir):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0))
    data = make_batch(batch=4, seq=12, seed=1)
    losses = [worker.train(data, NLLLoss())["loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5
    assert all(b < a for a, b in itertools.pairwise(losses))


def test_reference_model_is_the_initial_policy(llama_dir):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-2))
    data = make_batch(batch=4, seq=12)
    for _ in range(2):
        worker.train(data, NLLLoss())
    live = _params(worker)
    ref = worker.get_reference_policy_logprobs(data=data)["reference_logprobs"]
    assert (ref - hf_logprobs(llama_dir, data)).abs().max() <= 1e-4
    cur = worker.get_logprobs(data=data)["logprobs"]
    assert (cur - ref).abs().max() > 1e-2
    after = _params(worker)
    assert all(torch.equal(live[n], after[n]) for n in live)


def test_use_reference_model_restores_on_error(llama_dir):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-2))
    worker.train(make_batch(batch=4, seq=12), NLLLoss())
    live = _params(worker)
    with pytest.raises(RuntimeError, match="boom"), worker.use_reference_model():
        raise RuntimeError("boom")
    after = _params(worker)
    assert all(torch.equal(live[n], after[n]) for n in live)


class _NaNLoss(NLLLoss):
    def __call__(self, inputs, data, counts):
        loss, metrics = super().__call__(inputs, data, counts)
        return loss * float("nan"), metrics


class _NaNValueLoss(NLLLoss):
    """A NaN loss whose gradients are finite (the NaN comes from a term without gradient)."""

    def __call__(self, inputs, data, counts):
        loss, metrics = super().__call__(inputs, data, counts)
        return loss + torch.tensor(float("nan")), metrics


@pytest.mark.parametrize("bad", [_NaNLoss, _NaNValueLoss], ids=["nan-gradient", "nan-loss"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_non_finite_gradient_or_loss_skips_the_step(llama_dir, precision, bad):
    """The skip happens on the device (fused AdamW's found_inf): weights, fp32 masters, Adam's
    moments and step counts stay bitwise as they were, after a step that did apply. A NaN loss
    with finite gradients is skipped alike."""
    from policyworker.train.optimizer import optimizer_tensors

    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-2), precision=precision)
    data = make_batch(batch=4, seq=12)
    assert worker.train(data, NLLLoss())["skipped_steps"] == 0
    before = _params(worker)
    state = [t.clone() for t in optimizer_tensors(worker.state.optimizer)]
    metrics = worker.train(data, bad())
    assert metrics["skipped_steps"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert all(torch.equal(before[n], p) for n, p in _params(worker).items())
    after = list(optimizer_tensors(worker.state.optimizer))
    assert len(after) == len(state) and all(
        torch.equal(a, b) for a, b in zip(after, state, strict=True)
    )
    assert worker.state.scheduler.num_steps == 1
    # the worker still trains afterwards
    assert worker.train(data, NLLLoss())["skipped_steps"] == 0


def test_one_scheduler_step_per_global_batch(llama_dir):
    sched = SchedulerConfig(style="linear", warmup_steps=2, decay_steps=10)
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3), scheduler=sched)
    data = make_batch(batch=8, seq=12)
    m = worker.train(data, NLLLoss(), gbs=4, mbs=2)
    assert m["num_global_batches"] == 2 and m["num_microbatches"] == 4
    assert worker.state.scheduler.num_steps == 2
    assert m["lr"] == pytest.approx(0.5e-3)  # the second step's warm-up lr
    assert worker.state.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_metrics_report_the_contract(llama_dir):
    worker = make_worker(llama_dir)
    data = make_batch(batch=4, seq=12)
    data["sample_mask"][1] = 0
    m = worker.train(data, ClippedPGLoss())
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "global_valid_toks",
        "num_microbatches",
        "probs_ratio",
        "clipped_fraction",
        "token_mult_prob_error",
        "kl_penalty",
        "entropy",
        "probs_ratio_min",
        "probs_ratio_max",
        "gen_kl_error",
        "policy_kl_error",
        "js_divergence_error",
        "sampling_importance_ratio",
        "approx_entropy",
        "num_valid_samples",
    ):
        assert key in m, key
    view = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    assert m["global_valid_toks"] == view.sum().item()
    assert m["global_valid_seqs"] == 3
    assert m["num_valid_samples"] == 3
    assert m["probs_ratio_min"] <= m["probs_ratio"] <= m["probs_ratio_max"]


def test_modes_follow_the_call_and_state_bytes_follow_the_state(llama_dir):
    """Every module trains in train() and evaluates in get_logprobs, switching back and forth
    (the switch is skipped when the model is in the mode already); the reported optimizer
    bytes are a fresh count before the first step, after it and after the next."""
    from policyworker.train.optimizer import optimizer_state_bytes

    worker = make_worker(llama_dir)
    data = make_batch(batch=4, seq=12)
    model, seen = worker.state.model, []
    hook = model.register_forward_pre_hook(
        lambda mod, args: seen.append({m.training for m in mod.modules()})
    )
    before = worker.train(data, NLLLoss(), eval_mode=True)["optimizer_state_bytes"]
    first = worker.train(data, NLLLoss())["optimizer_state_bytes"]
    worker.get_logprobs(data=data)
    second = worker.train(data, NLLLoss())["optimizer_state_bytes"]
    worker.get_logprobs(data=data)
    hook.remove()
    phases = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]  # per call
    assert phases == [{True}, {False}, {True}, {False}]
    assert before == 0  # fp32: the parameters are their own masters; no Adam state yet
    assert first == second == optimizer_state_bytes(worker.state.optimizer) > 0


def test_bfloat16_trains_with_fp32_master_weights(llama_dir):
    worker = make_worker(
        llama_dir, precision="bfloat16", optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0)
    )
    assert next(worker.state.model.parameters()).dtype == torch.bfloat16
    masters = [p for g in worker.state.optimizer.param_groups for p in g["params"]]
    assert masters and all(p.dtype == torch.float32 for p in masters)
    data = make_batch(batch=4, seq=12, seed=1)
    losses = [worker.train(data, NLLLoss())["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.2
    # the bf16 weights are the rounded fp32 masters after every step
    (part,) = worker.state.optimizer.chained_optimizers
    models = itertools.chain.from_iterable(part.float16_groups)
    mains = itertools.chain.from_iterable(part.fp32_from_float16_groups)
    for model_p, main_p in zip(models, mains, strict=True):
        assert torch.equal(model_p, main_p.to(torch.bfloat16))
    # bf16 logprobs stay close to the fp32 reference of the same (initial) weights
    ref = worker.get_reference_policy_logprobs(data=data)["reference_logprobs"]
    assert (ref - hf_logprobs(llama_dir, data)).abs().max() < 0.1


def test_bf16_gradient_buffers(llama_dir):
    """`grad_reduce_in_fp32: false` (NeMo-RL's Megatron recipes): DDP's buffers in bf16. With one
    micro-batch a step the buffer holds the backward's bf16 gradient exactly, so the steps equal
    the fp32-buffer worker's bitwise; with two, the sum is rounded to bf16 and stays close."""
    data = make_batch(batch=4, seq=12, seed=1)
    results = {}
    for fp32, mbs in ((True, 4), (False, 4), (True, 2), (False, 2)):
        opt = OptimizerConfig(lr=1e-3, grad_reduce_in_fp32=fp32)
        worker = make_worker(
            llama_dir, precision="bfloat16", optimizer=opt, train_micro_batch_size=mbs
        )
        (buffer, *_) = grad_buffers(worker.state.ddp)
        assert buffer.dtype == (torch.float32 if fp32 else torch.bfloat16)
        losses = [worker.train(data, NLLLoss())["loss"] for _ in range(3)]
        weights = dict(worker.export_hf_weights())
        results[fp32, mbs] = losses, {k: v.clone() for k, v in weights.items()}
    for fp32 in (True, False):  # train_bs 4: one micro-batch of 4 or two of 2
        assert results[fp32, 4][0][0] == pytest.approx(results[fp32, 2][0][0], rel=1e-2)
    (l32, w32), (l16, w16) = results[True, 4], results[False, 4]
    assert l32 == l16 and all(torch.equal(w32[k], w16[k]) for k in w32)
    (l32, w32), (l16, w16) = results[True, 2], results[False, 2]
    assert l16[-1] == pytest.approx(l32[-1], rel=1e-2) and l16[-1] < l16[0]


def test_set_learning_rate(llama_dir):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3))
    data = make_batch(batch=4, seq=12)
    assert worker.train(data, NLLLoss())["lr"] == pytest.approx(1e-3)
    worker.set_learning_rate(2e-4)
    assert worker.train(data, NLLLoss())["lr"] == pytest.approx(2e-4)
    with pytest.raises(ValueError, match="lr"):
        worker.set_learning_rate(0.0)


def _torch_reference_steps(folder, batches, *, lr, eps, weight_decay, max_grad_norm):
    """The same steps in plain torch on the HF model: NLL / global tokens, clip_grad_norm_, AdamW
    (megatron's default: no weight decay on 1-D params)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        foreach=True,
    )
    norms = []
    for data in batches:
        ids = data["input_ids"]
        mask = (torch.arange(ids.shape[1])[None, :] < data["input_lengths"][:, None]).long()
        logits = model(ids, attention_mask=mask).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        tok = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss = -(lp * tok).sum() / (tok.sum() + 1e-8)
        opt.zero_grad()
        loss.backward()
        clip = max_grad_norm if max_grad_norm > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return dict(model.named_parameters()), norms


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no-clip", "clip"])
def test_steps_equal_plain_torch(llama_dir, max_grad_norm):
    """Two optimizer steps equal HF + torch clip_grad_norm_ + AdamW (Adam's eps is large so
    that the update depends on the gradient's scale, i.e. on the clip)."""
    hp = dict(lr=1e-2, eps=1e-2, weight_decay=0.1)
    batches = [make_batch(batch=4, seq=14, seed=s) for s in (1, 2)]
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(**hp), max_grad_norm=max_grad_norm)
    norms = [worker.train(b, NLLLoss())["grad_norm"] for b in batches]
    ref, ref_norms = _torch_reference_steps(llama_dir, batches, max_grad_norm=max_grad_norm, **hp)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    if max_grad_norm:
        assert min(norms) > 2 * max_grad_norm  # both steps were clipped
    for name, tensor in worker.export_hf_weights():
        torch.testing.assert_close(tensor.cpu(), ref[name].detach(), rtol=0, atol=2e-6, msg=name)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_distributed_optimizer_equals_plain_on_one_rank(llama_dir, precision):
    data = make_batch(batch=4, seq=12)
    results = []
    for distributed in (False, True):
        opt = OptimizerConfig(lr=1e-3, use_distributed_optimizer=distributed)
        worker = make_worker(llama_dir, precision=precision, optimizer=opt)
        metrics = [worker.train(data, ClippedPGLoss()) for _ in range(2)]
        results.append((metrics, _params(worker)))
    (m0, p0), (m1, p1) = results
    for a, b in zip(m0, m1, strict=True):
        assert a["loss"] == b["loss"]
        # the norm sums the same squares grouped by buckets instead of by tensors
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    assert all(torch.equal(p0[n], p1[n]) for n in p0)  # below the clip: the same Adam updates
    assert m1[-1]["optimizer_state_bytes"] == m0[-1]["optimizer_state_bytes"] > 0


def test_the_tensor_parallel_report_and_the_seeds_check_dim_skip_keys(llama_dir):
    """The seed's `check_tensor_parallel_attributes` at TP1 (TP2: tests/test_parallel.py), and
    `train(check_dim_skip_keys=...)`, which the seed refuses on Megatron, refused by name."""
    worker = make_worker(llama_dir)
    report = worker.check_tensor_parallel_attributes()
    names = [n for n, _ in worker.state.model.named_parameters()]
    assert report["tp_size"] == 1 and report["total_params"] == len(names)
    assert sorted(report["tp_params"] + report["non_tp_params"]) == sorted(names)
    assert any("linear_qkv.weight" in n for n in report["tp_params"])
    assert all("layernorm" in n or "norm" in n for n in report["non_tp_params"])
    before = {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}
    with pytest.raises(ValueError, match="check_dim_skip_keys"):
        worker.train(make_batch(batch=4, seq=12), NLLLoss(), check_dim_skip_keys=["x"])
    assert all(torch.equal(p, before[n]) for n, p in worker.state.model.named_parameters())


def test_overlapped_communication_switches_and_equals_overlap_off(llama_dir):
    """One rank (DP2: tests/test_parallel.py): the seed's forward pre-hook switches, refused
    without `overlap_param_gather`; steps with the hooks on, off and toggled equal overlap off;
    megatron's rule that the gather needs the distributed optimizer and the grad overlap."""
    data = make_batch(batch=4, seq=12)
    plain = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3))
    with pytest.raises(ValueError, match="overlap_param_gather is off"):
        plain.enable_forward_pre_hook()
    overlap = OptimizerConfig(
        lr=1e-3, use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
    )
    worker = make_worker(llama_dir, optimizer=overlap)
    hooks = worker.state.overlap
    assert hooks.hooks_enabled
    want = [plain.train(data, NLLLoss())["loss"] for _ in range(3)]
    got = [worker.train(data, NLLLoss())["loss"]]
    worker.disable_forward_pre_hook(param_sync=False)
    assert not hooks.hooks_enabled and not hooks.params_pending()
    got.append(worker.train(data, NLLLoss())["loss"])
    assert not hooks.params_pending()  # a step without hooks gathers at once
    worker.enable_forward_pre_hook()
    worker.enable_forward_pre_hook()  # idempotent
    got.append(worker.train(data, NLLLoss())["loss"])
    assert got == pytest.approx(want, rel=1e-6)
    assert torch.equal(
        worker.get_logprobs(data=data)["logprobs"], plain.get_logprobs(data=data)["logprobs"]
    )
    for bad in (
        dict(overlap_param_gather=True),
        dict(overlap_param_gather=True, use_distributed_optimizer=True),
    ):
        with pytest.raises(ValueError, match="overlap_param_gather"):
            OptimizerConfig(**bad).validate()
