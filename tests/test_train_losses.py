"""Every loss through the worker: invariance to the micro-batch size (fp32 <= 1e-6), and short
DPO and distillation runs that lower their loss."""

import pytest
import torch
from conftest import make_worker
from helpers import make_batch

from policyworker import BatchedDataDict
from policyworker.config import OptimizerConfig
from policyworker.losses import (
    ClippedPGConfig,
    ClippedPGLoss,
    DistillationConfig,
    DistillationLoss,
    DPOConfig,
    DPOLoss,
    NLLLoss,
)

LOSSES = {
    "nll": NLLLoss(),
    "grpo-is-tis-kl-nll": ClippedPGLoss(
        ClippedPGConfig(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=1.5,
            reference_policy_kl_penalty=0.1,
            positive_example_nll_weight=0.2,
        )
    ),
    "gspo": ClippedPGLoss(
        ClippedPGConfig(
            sequence_level_importance_ratios=True,
            token_level_loss=False,
            use_importance_sampling_correction=True,
        )
    ),
    "cispo-icepop": ClippedPGLoss(
        ClippedPGConfig(
            use_cispo=True,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio=3.0,
            truncated_importance_sampling_ratio_min=0.3,
        )
    ),
    "dpo": DPOLoss(DPOConfig(sft_loss_weight=0.1, preference_average_log_probs=True)),
    "distill-mixed": DistillationLoss(DistillationConfig(kl_type="mixed")),
    "distill-reverse-zero-outside": DistillationLoss(
        DistillationConfig(kl_type="reverse", zero_outside_topk=True)
    ),
}


def _params(worker):
    return {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}


@pytest.mark.parametrize("name", LOSSES)
def test_loss_is_invariant_to_micro_batch_size(llama_dir, name):
    loss_fn = LOSSES[name]
    data = make_batch(batch=4, seq=14, seed=3)
    data["sample_mask"][3] = 0.0
    results = []
    for mbs in (2, 4):  # 2: DPO pairs stay in one micro-batch
        worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3), max_grad_norm=0.0)
        results.append((worker.train(data, loss_fn, mbs=mbs), _params(worker)))
    (m2, p2), (m4, p4) = results
    assert m2["num_microbatches"] == 2 and m4["num_microbatches"] == 1
    for key, value in m4.items():
        if key not in ("num_microbatches", "lr", "all_mb_metrics"):  # these follow the cut
            assert m2[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert m2["grad_norm"] > 0
    for key, per_mb in m2["all_mb_metrics"].items():  # the two halves make up the whole
        if not key.endswith(("_min", "_max")):
            assert sum(per_mb) == pytest.approx(m4[key], rel=1e-6, abs=1e-6), key
    # Adam's first step is ~lr * sign(g): an element whose gradient is near eps moves by a
    # sizeable fraction of lr on a last-bit difference (which the CPU's kernels decide), so the
    # bound is 1e-4 = lr / 10, as for the parallel layouts; a normalization error moves ~lr.
    for n in p2:
        assert (p2[n] - p4[n]).abs().max() <= 1e-4, n


def test_dpo_refuses_micro_batches_that_split_pairs(llama_dir):
    worker = make_worker(llama_dir)
    with pytest.raises(ValueError, match="mbs: expected a multiple of 2"):
        worker.train(make_batch(batch=4, seq=10), DPOLoss(), mbs=1)


def test_a_short_dpo_run_lowers_its_loss(llama_dir):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0))
    data = make_batch(batch=4, seq=12, seed=7)
    data["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(data=data)[
        "reference_logprobs"
    ]
    loss_fn = DPOLoss(DPOConfig(reference_policy_kl_penalty=0.5))
    history = [worker.train(data, loss_fn, mbs=2) for _ in range(8)]
    assert history[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["accuracy"] == 1.0 and history[-1]["rewards_margin_mean"] > 0


def test_a_short_distillation_run_lowers_its_loss(llama_dir, tmp_path):
    from helpers import make_hf_model

    teacher_dir = make_hf_model(tmp_path / "teacher", "qwen2", seed=11, vocab_size=101)
    data = make_batch(batch=4, seq=12, seed=8)
    top = make_worker(teacher_dir).get_topk_logits(data=data, k=8)
    batch = BatchedDataDict(
        {k: data[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")}
    )
    batch["teacher_topk_logits"] = top["topk_logits"]
    batch["teacher_topk_indices"] = top["topk_indices"]
    student = make_worker(llama_dir, optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0))
    loss_fn = DistillationLoss(DistillationConfig(kl_type="forward"))
    history = [student.train(batch, loss_fn)["loss"] for _ in range(8)]
    assert history[-1] < 0.5 * history[0]
    assert torch.isfinite(torch.tensor(history)).all()
