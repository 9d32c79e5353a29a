"""TP2, PP2 and DP2 on two CPU ranks (gloo) give the single-rank results: logprobs, top-k,
reference logprobs, train metrics and the weights after two GRPO steps (via their logprobs), and
the loss and gradient norm of a step of ClippedPG (IS, TIS, KL, NLL), DPO and distillation."""

from pathlib import Path

import pytest
import torch
from helpers import hf_logprobs, make_hf_model, torchrun
from multirank import config, fixed_batch, layout_results

from policyworker.worker import MegatronPolicyWorker

pytestmark = pytest.mark.processes

VOCAB = 128
# (tp, pp, flags); dp is what remains of 2. Every layout compares to the single rank, which runs
# unpacked with the plain optimizer and unchunked logits. Plain PP2 and DP2 are the paths of
# "pp2-split-step-chunked" (unpacked; split steps stream the same micro-batches) and
# "dp2-distributed-optimizer" (unpacked; the optimizer only adds sharding): they run there.
LAYOUTS = {
    "tp2": (2, 1, ()),
    "pp2-packed": (1, 2, ("pack",)),
    "dp2-packed-unequal-shards": (1, 1, ("pack",)),
    "dp2-distributed-optimizer": (1, 1, ("distopt",)),
    # megatron's overlapped grad reduce and param gather: the same numbers as without
    "dp2-distributed-optimizer-overlapped": (1, 1, ("distopt", "overlap")),
    "tp2-sequence-parallel": (2, 1, ("sp",)),
    "tp2-sequence-parallel-packed-chunked": (2, 1, ("sp", "pack", "chunk")),
    "cp2": (1, 1, ("cp",)),
    "cp2-packed-chunked": (1, 1, ("cp", "pack", "chunk")),
    # split-step training: each rank streams its share in two chunks
    "dp2-split-step-packed-overlapped": (1, 1, ("split", "pack", "distopt", "overlap")),
    "pp2-split-step-chunked": (1, 2, ("split", "chunk")),
    # batch_invariant: a decode step's linear layers padded to 256 rows under TP (SP switched off)
    "tp2-sequence-parallel-batch-invariant": (2, 1, ("sp", "invariant")),
    # micro-batches cut by a token budget, widths rounded up to TP: wider than an odd batch
    "tp2-sequence-parallel-dynamic-batching": (2, 1, ("sp", "dyn")),
}


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Tied embeddings: under PP the last stage holds a synced copy of the embedding.
    folder = tmp_path_factory.mktemp("qwen2_tied")
    return make_hf_model(folder, "qwen2", vocab_size=VOCAB, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def single(tied_dir: Path) -> dict[str, object]:
    worker = MegatronPolicyWorker(config(str(tied_dir), tp=1, pp=1))
    return layout_results(worker, fixed_batch(VOCAB))


def launch(
    folder: Path,
    out: Path,
    layouts: dict[str, tuple[int, int, tuple[str, ...]]],
    nproc: int,
    models: dict[str, Path] | None = None,
) -> None:
    """Every layout of `layouts` in one torchrun launch of `nproc` ranks (multirank.py), of
    `folder`'s model or, for a layout named in `models`, that one."""
    models = models or {}
    specs = [
        f"{name}:{tp}:{pp}:{','.join(flags)}" + (f":{models[name]}" if name in models else "")
        for name, (tp, pp, flags) in layouts.items()
    ]
    script = Path(__file__).parent / "multirank.py"
    torchrun(script, folder, out, *specs, nproc=nproc, timeout_s=1200)


FOUR_RANKS = {
    "tp2-pp2-sp-packed": (2, 2, ("sp", "pack")),
    "cp2-tp2-packed-chunked": (2, 1, ("cp", "pack", "chunk")),
}


@pytest.fixture(scope="module")
def two_ranks(tied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The results of every two-rank layout, from one launch (each test reads its own)."""
    out = tmp_path_factory.mktemp("two_ranks")
    launch(tied_dir, out, LAYOUTS, nproc=2)
    return out


@pytest.fixture(scope="module")
def four_ranks(tied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("four_ranks")
    launch(tied_dir, out, FOUR_RANKS, nproc=4)
    return out


def results(out: Path, name: str) -> dict[str, object]:
    return torch.load(out / f"{name}.pt", weights_only=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_rank(layout, tied_dir, single, two_ranks, tmp_path):
    tp, pp, flags = LAYOUTS[layout]
    got = results(two_ranks, layout)
    cp = 2 if "cp" in flags else 1
    assert (got["dims"].tp, got["dims"].pp, got["dims"].cp) == (tp, pp, cp)
    assert got["dims"].dp == 2 // (tp * pp * cp)
    _assert_matches(got, single, tied_dir, VOCAB, two_ranks / f"{layout}.hf", pp=pp)
    assert "greedy_ids" in got and "sampled_ids" in got
    if (tp, pp) == (2, 1):  # the seed's TP report: the same split of the same names
        report, want = got["tp_attributes"], single["tp_attributes"]
        assert (report["tp_size"], want["tp_size"]) == (2, 1)
        assert report["tp_params"] == want["tp_params"]
        assert report["non_tp_params"] == want["non_tp_params"]
    if not {"pack", "cp", "sp"} & set(flags):  # the same micro-batches, padding included
        scales, want = got["qkv_scales"]["layers"], single["qkv_scales"]["layers"]
        assert scales.keys() == want.keys()
        for name, value in want.items():  # the amax over every rank's heads, tokens, layers
            assert scales[name] == pytest.approx(value, rel=1e-5), name
    if pp == 1:  # every weight, read right after a step (overlap: before any forward gathers)
        after, want = got["export_after_train"], single["export_after_train"]
        assert after.keys() == want.keys()
        for name, sums in want.items():
            assert after[name] == pytest.approx(sums, rel=1e-5, abs=1e-4), name
    if pp == 1:  # the full-vocabulary payload, gathered over TP and CP, unpacked
        assert (got["teacher_full_payload"] - single["teacher_full_payload"]).abs().max() <= 1e-4
    if "cp" in flags:  # context parallelism: no device read in the layer loop
        assert got["host_reads_in_layers"] == []
    if "distopt" in flags:  # the optimizer state is split over the two data-parallel ranks
        whole = single["train"][-1]["optimizer_state_bytes"]
        for rank_metrics in got["train"]:
            assert rank_metrics[-1]["optimizer_state_bytes"] <= 0.6 * whole


def test_tp2_by_pp2_on_four_ranks(tied_dir, single, four_ranks):
    """The 4-rank composition: two pipeline stages, each split over two tensor-parallel ranks,
    with sequence parallelism and packing."""
    got = results(four_ranks, "tp2-pp2-sp-packed")
    assert (got["dims"].tp, got["dims"].pp, got["dims"].dp, got["dims"].sp) == (2, 2, 1, True)
    _assert_matches(got, single, tied_dir, VOCAB, four_ranks / "tp2-pp2-sp-packed.hf", pp=2)


def test_cp2_by_tp2_on_four_ranks(tied_dir, single, four_ranks):
    """Context parallelism composed with tensor parallelism, packed, logits in chunks."""
    got = results(four_ranks, "cp2-tp2-packed-chunked")
    assert (got["dims"].tp, got["dims"].cp, got["dims"].dp) == (2, 2, 1)
    assert got["host_reads_in_layers"] == []
    _assert_matches(got, single, tied_dir, VOCAB, four_ranks / "cp2-tp2-packed-chunked.hf", pp=1)


def test_tp3_on_a_vocabulary_that_3_does_not_divide(tmp_path_factory, tmp_path):
    """127 tokens over 3 ranks: the vocabulary is padded to 129; the padded columns never count
    (in chunked logits too) and the export carries the true 127 rows."""
    folder = make_hf_model(
        tmp_path_factory.mktemp("qwen2_odd"),
        "qwen2",
        vocab_size=127,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=192,
        tie_word_embeddings=True,
    )
    single = layout_results(MegatronPolicyWorker(config(str(folder), tp=1, pp=1)), fixed_batch(127))
    launch(folder, tmp_path, {"tp3": (3, 1, ("chunk",))}, nproc=3)
    got = results(tmp_path, "tp3")
    assert (got["dims"].tp, got["dims"].dp) == (3, 1)
    _assert_matches(got, single, folder, 127, tmp_path / "tp3.hf", pp=1)


def _assert_matches(got, single, folder, vocab, exported, *, pp):
    """A layout's results against the single rank's and transformers'."""
    hf = hf_logprobs(folder, fixed_batch(vocab))
    assert (got["logprobs"] - hf).abs().max() <= 1e-4
    for key in ("logprobs", "reference_logprobs", "topk_logits", "reference_after"):
        assert (got[key] - single[key]).abs().max() <= 1e-5, key
    assert int(got["topk_indices"].max()) < vocab
    assert torch.equal(got["topk_indices"], single["topk_indices"])

    for step, want in enumerate(single["train"]):
        for rank_metrics in got["train"]:  # every rank reports the global figures
            for key in ("loss", "grad_norm", "global_valid_toks"):
                assert rank_metrics[step][key] == pytest.approx(want[key], rel=1e-5), (step, key)
            for key in ("probs_ratio", "probs_ratio_min", "accuracy", "kl_penalty"):
                if key in want:
                    assert rank_metrics[step][key] == pytest.approx(want[key], rel=1e-5), key
    # Training moved the weights, and moved them the same way.
    moved = (single["logprobs_after"] - single["logprobs"]).abs().max()
    assert moved > 1e-2
    assert (got["logprobs_after"] - single["logprobs_after"]).abs().max() <= 1e-4
    assert (got["logprobs_final"] - single["logprobs_final"]).abs().max() <= 1e-4
    # the forward-only calls on a batch of odd width (wider micro-batches under TP2 + SP)
    for key in ("odd_logprobs", "odd_topk_logits", "odd_reference"):
        assert (got[key] - single[key]).abs().max() <= 1e-5, key
    if pp == 1:
        assert (got["odd_payload"] - single["odd_payload"]).abs().max() <= 1e-4
    if "routes" not in single:  # causal: the whole batch's first positions (as routed)
        width = single["odd_logprobs"].shape[1]
        assert (single["odd_logprobs"] - single["logprobs_final"][:, :width]).abs().max() <= 1e-5
    # generation in the worker: the same tokens, greedy and sampled (keyed by the row's index)
    for name in ("greedy", "sampled"):
        assert torch.equal(got[f"{name}_ids"], single[f"{name}_ids"]), name
        assert (got[f"{name}_logprobs"] - single[f"{name}_logprobs"]).abs().max() <= 1e-4, name
    # The HF export (TP shards gathered, one file per pipeline stage) holds the trained weights.
    assert len(list(exported.glob("*.safetensors"))) == pp
    assert (hf_logprobs(exported, fixed_batch(vocab)) - got["logprobs_final"]).abs().max() <= 1e-4
