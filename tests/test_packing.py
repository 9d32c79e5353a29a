"""Sequence packing and token-budget micro-batches: the packers, the THD layout, and the worker
giving the same logprobs, top-k, losses, gradients and weights as fixed-size padded micro-batches."""

import random

import pytest
import torch
from conftest import make_worker
from helpers import hf_logprobs, make_batch

from policyworker.config import DynamicBatchingConfig, OptimizerConfig, SequencePackingConfig
from policyworker.data.microbatch import Packed, TokenBudget
from policyworker.data.packing import (
    PACKERS,
    PackedLayout,
    concatenative,
    sorted_cuts,
)
from policyworker.losses import ClippedPGConfig, ClippedPGLoss, DPOLoss, NLLLoss
from policyworker.ops.packed import packed_positions

# --- the packers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", PACKERS)
@pytest.mark.parametrize("seed", range(5))
def test_packers_place_every_item_once_within_capacity(algorithm, seed):
    rng = random.Random(seed)
    capacity = 100
    sizes = [
        rng.choice([rng.randint(1, 15), rng.randint(20, 60), rng.randint(60, 100)])
        for _ in range(60)
    ]
    bins = PACKERS[algorithm](sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(b and sum(sizes[i] for i in b) <= capacity for b in bins)
    assert len(bins) >= -(-sum(sizes) // capacity)


def test_concatenative_keeps_the_order():
    # The reference's documented example.
    assert concatenative([4, 1, 3, 2, 1, 3, 4, 5], 5) == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert concatenative([4, 1, 3, 2, 1, 3, 4, 5], 8) == [[0, 1, 2], [3, 4, 5], [6], [7]]


def test_ffd_and_mffd_pack_tighter_than_concatenation():
    sizes = [60, 45, 40, 35, 30, 20, 15, 15, 10, 5, 5, 5, 55, 50, 45]
    assert len(PACKERS["first_fit_decreasing"](sizes, 100)) == 5  # 435 tokens: 5 is optimal
    assert len(PACKERS["modified_first_fit_decreasing"](sizes, 100)) == 5
    alternating = [60, 50, 60, 50, 40, 40]
    assert len(concatenative(alternating, 100)) == 5
    assert len(PACKERS["first_fit_decreasing"](alternating, 100)) == 3


def test_sorted_cuts_pad_each_micro_batch_to_its_longest_within_budget():
    lengths = [5, 30, 7, 8, 29, 3, 31, 6]
    bins = sorted_cuts(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(len(b) * max(lengths[i] for i in b) <= 64 for b in bins)
    assert [sorted(lengths[i] for i in b) for b in bins] == [[3, 5, 6, 7, 8], [29, 30], [31]]


def test_packed_layout_round_trip():
    layout = PackedLayout.of([3, 5, 1], divisible_by=4, total=16)
    assert layout.padded == (4, 8, 4) and layout.total == 16 and layout.starts == [0, 4, 12]
    rows = torch.arange(1, 19).reshape(3, 6).float()
    packed = layout.pack(rows)  # [1, 16]
    assert packed[0, :4].tolist() == [1, 2, 3, 0] and packed[0, 12:].tolist() == [13, 0, 0, 0]
    back = layout.unpack(packed, 6)
    assert back.tolist() == [[1, 2, 3, 0, 0, 0], [7, 8, 9, 10, 11, 0], [13, 0, 0, 0, 0, 0]]
    assert layout.positions(torch.device("cpu"))[0].tolist() == [0, 1, 2, 3, *range(8), 0, 1, 2, 3]
    params = layout.seq_params(torch.device("cpu"))
    assert params.cu_seqlens_q.tolist() == [0, 3, 8, 9]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12, 16] and params.max_seqlen_q == 8


def test_packed_positions_restart_at_every_boundary():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # an empty sequence; 2 tokens after the end
    assert packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]


# --- the worker: packed and budgeted equal fixed-size ---------------------------------------------

LENGTHS = [14, 3, 9, 12, 5, 14, 2, 7]


def _data(seed=3):
    return make_batch(batch=8, seq=14, seed=seed, lengths=LENGTHS)


PLANS = {
    "packed-mffd": dict(
        sequence_packing=SequencePackingConfig(
            enabled=True, train_mb_tokens=24, logprob_mb_tokens=20
        )
    ),
    "packed-ffd-div4": dict(
        sequence_packing=SequencePackingConfig(
            enabled=True,
            algorithm="first_fit_decreasing",
            train_mb_tokens=32,
            logprob_mb_tokens=32,
            make_sequence_length_divisible_by=4,
        )
    ),
    "packed-concat": dict(
        sequence_packing=SequencePackingConfig(
            enabled=True, algorithm="concatenative", train_mb_tokens=30, logprob_mb_tokens=30
        )
    ),
    "dynamic": dict(
        dynamic_batching=DynamicBatchingConfig(
            enabled=True, train_mb_tokens=30, logprob_mb_tokens=28
        )
    ),
}


@pytest.fixture(scope="module")
def fixed_results(llama_dir):
    return _results(
        make_worker(
            llama_dir,
            optimizer=OptimizerConfig(lr=1e-3),
            max_grad_norm=0.0,
            train_global_batch_size=8,
            train_micro_batch_size=2,
        )
    )


def _results(worker):
    data = _data()
    out = {"logprobs": worker.get_logprobs(data=data)["logprobs"]}
    top = worker.get_topk_logits(data=data, k=5)
    out["topk_logits"], out["topk_indices"] = top["topk_logits"], top["topk_indices"]
    loss = ClippedPGLoss(
        ClippedPGConfig(reference_policy_kl_penalty=0.1, use_importance_sampling_correction=True)
    )
    out["train"] = [worker.train(data, loss) for _ in range(2)]
    out["logprobs_after"] = worker.get_logprobs(data=data)["logprobs"]
    return out


@pytest.mark.parametrize("plan", PLANS)
def test_packed_and_budgeted_equal_fixed_micro_batches(llama_dir, fixed_results, plan):
    worker = make_worker(
        llama_dir,
        optimizer=OptimizerConfig(lr=1e-3),
        max_grad_norm=0.0,
        train_global_batch_size=8,
        train_micro_batch_size=2,
        **PLANS[plan],
    )
    got = _results(worker)
    for key in ("logprobs", "topk_logits", "logprobs_after"):
        assert (got[key] - fixed_results[key]).abs().max() <= 1e-5, key
    assert torch.equal(got["topk_indices"], fixed_results["topk_indices"])
    valid = torch.arange(14)[None, :] < torch.tensor(LENGTHS)[:, None]
    assert (got["logprobs"][~valid] == 0).all() and (got["logprobs"][:, 0] == 0).all()
    for step, want in enumerate(fixed_results["train"]):
        for key in ("loss", "grad_norm", "probs_ratio", "kl_penalty", "global_valid_toks"):
            assert got["train"][step][key] == pytest.approx(want[key], rel=1e-5), (step, key)
    assert got["train"][0]["num_microbatches"] < fixed_results["train"][0]["num_microbatches"] == 4
    moved = (fixed_results["logprobs_after"] - fixed_results["logprobs"]).abs().max()
    assert moved > 1e-2


def test_packed_logprobs_equal_transformers(llama_dir):
    worker = make_worker(
        llama_dir, sequence_packing=SequencePackingConfig(enabled=True, logprob_mb_tokens=40)
    )
    data = _data()
    assert (
        worker.get_logprobs(data=data)["logprobs"] - hf_logprobs(llama_dir, data)
    ).abs().max() <= 1e-4


def test_the_packed_plan_uses_few_bins_and_restores_order(llama_dir):
    plan = Packed(
        algorithm="first_fit_decreasing", train_tokens=24, logprob_tokens=24, divisible_by=1
    )
    data = _data()
    mbs = plan.split(data, train=True, mbs=2)
    assert sorted(r for mb in mbs for r in mb.rows) == list(range(8))
    assert all(mb.layout.total <= 24 for mb in mbs) and len(mbs) == 3  # 66 tokens, bins of 24
    for mb in mbs:
        assert torch.equal(
            mb.data["input_ids"], data["input_ids"][mb.rows][:, : mb.data["input_ids"].shape[1]]
        )


def test_dpo_pairs_stay_together_when_packed(llama_dir):
    data = make_batch(batch=4, seq=12, seed=4, lengths=[12, 4, 5, 11])
    results = []
    for extra in (
        {},
        {"sequence_packing": SequencePackingConfig(enabled=True, train_mb_tokens=17)},
    ):
        worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3), **extra)
        results.append(worker.train(data, DPOLoss(), mbs=2))
    assert results[1]["num_microbatches"] == 2  # one pair per bin: 12+4 and 5+11
    for key in ("loss", "grad_norm", "accuracy", "rewards_margin_mean"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5), key
    plan = TokenBudget(train_tokens=10, logprob_tokens=10)
    plan.check([4, 5], train=True, rows_per_example=2)  # a pair padded to 5: 10 tokens, fits
    with pytest.raises(ValueError, match=r"dynamic_batching\.train_mb_tokens"):
        plan.check([4, 6], train=True, rows_per_example=2)


def test_a_sequence_longer_than_the_budget_is_refused_before_any_change(llama_dir):
    worker = make_worker(
        llama_dir,
        sequence_packing=SequencePackingConfig(
            enabled=True, train_mb_tokens=12, logprob_mb_tokens=10
        ),
    )
    data = _data()
    before = {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}
    with pytest.raises(ValueError, match=r"sequence_packing\.train_mb_tokens: .*length 14"):
        worker.train(data, NLLLoss())
    with pytest.raises(ValueError, match=r"sequence_packing\.logprob_mb_tokens: .*length 14"):
        worker.get_logprobs(data=data)
    assert all(torch.equal(before[n], p) for n, p in worker.state.model.named_parameters())
    assert worker.state.scheduler.num_steps == 0


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"sequence_packing": {"train_mb_tokens": 0}}, "sequence_packing.train_mb_tokens"),
        ({"dynamic_batching": {"logprob_mb_tokens": -5}}, "dynamic_batching.logprob_mb_tokens"),
        ({"sequence_packing": {"algorithm": "best_fit"}}, "sequence_packing.algorithm"),
        (
            {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": True}},
            "dynamic_batching.enabled",
        ),
    ],
)
def test_bad_packing_config(overrides, field):
    from policyworker.config import from_dict

    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        from_dict(__import__("policyworker").PolicyConfig, {"model_name": "/m", **overrides})


class _WithFiller:
    """A plan that appends one filler micro-batch, as a data-parallel peer with fewer would."""

    def __init__(self, plan):
        self.plan = plan

    def check(self, *args, **kw):
        self.plan.check(*args, **kw)

    def split(self, batch, **kw):
        mbs = self.plan.split(batch, **kw)
        return [*mbs, self.plan.filler(batch, mbs[0], kw.get("rows_per_example", 1))]


@pytest.mark.parametrize("packed", [False, True])
def test_fillers_add_no_loss_and_no_gradient(llama_dir, packed):
    extra = (
        {"sequence_packing": SequencePackingConfig(enabled=True, train_mb_tokens=40)}
        if packed
        else {}
    )
    results = []
    for with_filler in (False, True):
        worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-3), **extra)
        if with_filler:
            worker.plan = worker.trainer.plan = _WithFiller(worker.plan)
        m = worker.train(_data(), ClippedPGLoss(), gbs=8, mbs=4)
        results.append(
            (m, {n: p.detach().clone() for n, p in worker.state.model.named_parameters()})
        )
    (m0, p0), (m1, p1) = results
    assert m1["num_microbatches"] == m0["num_microbatches"] + 1
    for key in ("loss", "grad_norm", "global_valid_toks", "probs_ratio_min"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-6), key
    assert all(torch.equal(p0[n], p1[n]) for n in p0)


def test_context_parallel_needs_sequences_that_2cp_divides():
    """A packing divisor that 2*CP does not divide is refused, naming the field."""
    from types import SimpleNamespace

    from policyworker.config import PolicyConfig
    from policyworker.data.microbatch import build_plan
    from policyworker.parallel.dims import ParallelDims

    dims = ParallelDims(cp=2, dp=1)
    groups = SimpleNamespace(cp_rank=0, cp=None)
    bad = SequencePackingConfig(enabled=True, make_sequence_length_divisible_by=6)
    with pytest.raises(
        ValueError, match=r"make_sequence_length_divisible_by: expected a multiple of 4"
    ):
        build_plan(PolicyConfig(model_name="/m", sequence_packing=bad), dims, groups)
    plan = build_plan(PolicyConfig(model_name="/m"), dims, groups)
    assert plan.shape.cp_divisor == 4  # unpacked rows still run as sequences split in 2*CP chunks
    packed = build_plan(
        PolicyConfig(model_name="/m", sequence_packing=SequencePackingConfig(enabled=True)),
        dims,
        groups,
    )
    assert packed.divisible_by == 4


def test_context_parallel_chunks_are_balanced():
    from policyworker.parallel.context import gathered_order, local_positions

    # one sequence of 8 over CP2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions([8], 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions([8], 1, 2).tolist() == [2, 3, 4, 5]
    # two sequences (4 and 8 tokens): each split on its own
    assert local_positions([4, 8], 0, 2).tolist() == [0, 3, 4, 5, 10, 11]
    everyone = torch.cat([local_positions([4, 8], r, 2) for r in range(2)])
    order = gathered_order([4, 8], 2)
    assert torch.equal(everyone[order], torch.arange(12))
