"""Chunked logits (#28, `logprob_chunk_size`): the output layer, log-softmax, picks, entropy and
top-k run chunk by chunk, forward and backward. The numbers equal unchunked ones, and no tensor
of more than one chunk's logits is ever made."""

from __future__ import annotations

import pytest
import torch
from conftest import make_worker
from helpers import make_batch, make_hf_model
from multirank import layout_results
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from policyworker.config import PolicyConfig, SequencePackingConfig
from policyworker.losses import NLLLoss
from policyworker.ops.logprobs import Head, LogitOptions, logprobs_at, topk

F64 = torch.float64


@pytest.mark.parametrize("chunk", [None, 1, 4, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_equals_autograd_of_the_full_logits(chunk, temperature):
    """Values and gradients (hidden states and output rows) against float64 autograd of
    `log_softmax(hidden @ W.T / T)`, with padded vocabulary rows that never count."""
    g = torch.Generator().manual_seed(0)
    b, s, h, v, real, k = 2, 9, 6, 13, 11, 3
    hidden = torch.randn(b, s, h, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=F64, requires_grad=True)
    ids = torch.randint(0, real, (b, s, k), generator=g)
    opts = LogitOptions(temperature=temperature, tp_group=None, vocab_size=real, chunk_tokens=chunk)
    lp, ent = logprobs_at(Head(hidden, weight), ids, opts, entropy=True)
    ref = torch.log_softmax((hidden @ weight[:real].T) / temperature, -1)
    torch.testing.assert_close(lp, ref.gather(-1, ids), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=1e-12, atol=1e-12)
    w1, w2 = torch.randn(b, s, k, generator=g, dtype=F64), torch.randn(b, s, generator=g, dtype=F64)
    got = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), (hidden, weight))
    want_loss = (ref.gather(-1, ids) * w1).sum() - ((ref.exp() * ref).sum(-1) * w2).sum()
    want = torch.autograd.grad(want_loss, (hidden, weight))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
    assert (got[1][real:] == 0).all()  # the padding rows get no gradient

    vals, idx = topk(Head(hidden.detach(), weight.detach()), 4, opts)
    want_vals, want_idx = (hidden @ weight[:real].T / temperature).detach().topk(4)
    torch.testing.assert_close(vals, want_vals.float())
    assert torch.equal(idx, want_idx)


def test_only_the_asked_outputs_are_differentiated():
    """Entropy alone (no ids), and logprobs alone (no entropy): each gradient as autograd's."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 1, 5, generator=g, dtype=F64, requires_grad=True)
    weight = torch.randn(8, 5, generator=g, dtype=F64, requires_grad=True)
    opts = LogitOptions(temperature=1.0, tp_group=None, chunk_tokens=3)

    def ref() -> torch.Tensor:
        return torch.log_softmax(hidden @ weight.T, -1)

    no_ids = torch.zeros(10, 1, 0, dtype=torch.long)
    lp, ent = logprobs_at(Head(hidden, weight), no_ids, opts, entropy=True)
    assert lp.shape == (10, 1, 0)
    got = torch.autograd.grad(ent.sum(), hidden)[0]
    want = torch.autograd.grad(-(ref().exp() * ref()).sum(), hidden)[0]
    torch.testing.assert_close(got, want)
    ids = torch.randint(0, 8, (10, 1, 1), generator=g)
    lp, ent = logprobs_at(Head(hidden, weight), ids, opts)
    assert ent is None
    got = torch.autograd.grad(lp.sum(), weight)[0]
    want = torch.autograd.grad(ref().gather(-1, ids).sum(), weight)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_worker_results_equal_unchunked(tmp_path, packed):
    """Every path through the logits on one rank, with chunks of 5 tokens (which divide no
    micro-batch) and without: logprobs, top-k, reference logprobs, two GRPO steps, then a step
    of ClippedPG with every option, DPO and distillation with the student's outside mass
    (entropy and index logprobs together), and the logprobs after them."""
    folder = make_hf_model(tmp_path / "m", "qwen2", tie_word_embeddings=True)
    data = make_batch(batch=8, seq=14, seed=5, lengths=[14, 13, 14, 12, 3, 4, 2, 5], topk=5)
    packing = SequencePackingConfig(enabled=packed, train_mb_tokens=32, logprob_mb_tokens=32)
    out = {}
    for chunk in (None, 5):
        worker = make_worker(
            folder,
            train_global_batch_size=8,
            train_micro_batch_size=1,
            sequence_packing=packing,
            logprob_chunk_size=chunk,
        )
        out[chunk] = layout_results(worker, data)
        worker.shutdown()
    plain, chunked = out[None], out[5]
    for key in ("logprobs", "topk_logits", "reference_logprobs", "logprobs_after"):
        assert (chunked[key] - plain[key]).abs().max().item() <= 1e-6, key
    assert torch.equal(chunked["topk_indices"], plain["topk_indices"])
    assert (chunked["logprobs_final"] - plain["logprobs_final"]).abs().max().item() <= 1e-5
    for a, b in zip(plain["train"], chunked["train"], strict=True):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


class _LogitRows(TorchDispatchMode):
    """Records the largest number of rows of any tensor made with `width` columns (a vocabulary
    of a width no other dimension of the model has); views of existing tensors (a transposed
    weight) allocate nothing and are left out."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue
            if t.dim() >= 2 and t.shape[-1] == self.width:
                self.rows = max(self.rows, t.numel() // self.width)
        return out


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_no_more_than_one_chunk_of_logits_exists(tmp_path, packed):
    """Under chunking no tensor of the vocabulary's width has more rows than a chunk, in
    get_logprobs, get_topk_logits and a train step (forward and backward); without chunking
    the whole micro-batch's logits appear (the check sees them)."""
    vocab = 211  # no other dimension of the model is 211 wide
    folder = make_hf_model(tmp_path / "m", "llama", vocab_size=vocab)
    data = make_batch(batch=4, seq=24, vocab=vocab)
    packing = SequencePackingConfig(enabled=packed, train_mb_tokens=48, logprob_mb_tokens=48)
    seen = {}
    for chunk in (None, 8):
        worker = make_worker(folder, sequence_packing=packing, logprob_chunk_size=chunk)
        with _LogitRows(vocab) as probe:
            worker.get_logprobs(data=data)
            worker.get_topk_logits(data=data, k=3)
            worker.train(data, NLLLoss())
        seen[chunk] = probe.rows
        worker.shutdown()
    assert seen[8] <= 8
    assert seen[None] >= 24  # a micro-batch's tokens at once


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "1k"])
def test_a_bad_chunk_size_is_refused(bad):
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        PolicyConfig(model_name="m", logprob_chunk_size=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keys", "want"),
    [
        ({"logprob_chunk_size": 2048}, 2048),
        (
            {
                "megatron_cfg": {
                    "use_fused_linear_logprobs": True,
                    "fused_linear_logprobs_chunk_size": 128,
                }
            },
            128,
        ),
        (
            {
                "megatron_cfg": {
                    "use_fused_linear_logprobs": False,
                    "fused_linear_logprobs_chunk_size": 256,
                }
            },
            None,
        ),
        (
            {
                "logprob_chunk_size": 1024,
                "megatron_cfg": {
                    "use_fused_linear_logprobs": True,
                    "fused_linear_logprobs_chunk_size": 128,
                    "defer_fp32_logits": True,
                },
            },
            1024,
        ),
    ],
)
def test_the_references_keys_map_to_the_chunk_size(keys, want):
    """`logprob_chunk_size` maps; the fused output layer's chunk size becomes ours when it is
    switched on and ours is not given; `defer_fp32_logits` is accepted either way."""
    from policyworker.config.nemo_rl import policy_dict

    mcore = {"enabled": True, **keys.get("megatron_cfg", {})}
    section = {"model_name": "/ckpt", **keys, "megatron_cfg": mcore}
    got = policy_dict({"policy": section}, ignore_unsupported=False)
    assert got.get("logprob_chunk_size") == want


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_no_more_than_one_chunk_of_the_mlp_without_grad(tmp_path, packed):
    """Under chunking the dense MLP's intermediate ([tokens, 2 * ffn] gated, [tokens, ffn]
    after the activation) never has more rows than a chunk in get_logprobs and get_topk_logits
    (forwards without gradient), and the logprobs equal unchunked ones;
    without chunking the whole micro-batch's appears (the check sees it). Training's forward
    keeps the MLP whole: its activations are kept for the backward anyway."""
    ffn = 59  # 59 and 118 wide: no other dimension of the model is
    folder = make_hf_model(tmp_path / "m", "llama", intermediate_size=ffn)
    data = make_batch(batch=4, seq=24)
    packing = SequencePackingConfig(enabled=packed, train_mb_tokens=48, logprob_mb_tokens=48)
    seen, logprobs = {}, {}
    for chunk in (None, 8):
        worker = make_worker(folder, sequence_packing=packing, logprob_chunk_size=chunk)
        with _LogitRows(ffn) as act, _LogitRows(2 * ffn) as gated:
            logprobs[chunk] = worker.get_logprobs(data=data)["logprobs"]
            worker.get_topk_logits(data=data, k=3)
        seen[chunk] = max(act.rows, gated.rows)
        with _LogitRows(2 * ffn) as gated:
            worker.train(data, NLLLoss())
        assert gated.rows >= 24  # training: the whole micro-batch at once
        worker.shutdown()
    assert 0 < seen[8] <= 8
    assert seen[None] >= 24
    assert (logprobs[8] - logprobs[None]).abs().max().item() <= 1e-6


def test_rope_without_grad_rotates_in_place_a_chunk_at_a_time(monkeypatch):
    """Scoring's RoPE over more rows than `IN_PLACE_ROWS` writes over its input and makes
    nothing of more than a chunk's head vectors (the whole input has 21 · 4; cos and sin have one
    per row); the values are those of the out-of-place RoPE that autograd gets. Training's (a
    recomputed layer's gradient-free first pass, say) leaves its input alone: the phases say
    which (`model/paths.py`)."""
    from policyworker.model.attention import rotary as rotary_module
    from policyworker.model.paths import choose_paths

    cpu = torch.device("cpu")
    paths = choose_paths(cpu, torch.float32, batch_invariant=False, decode_attention="sdpa")
    assert paths.score.in_place and not paths.training.in_place
    monkeypatch.setattr(rotary_module, "IN_PLACE_ROWS", 8)
    rotary = rotary_module.Rotary()
    rotary.inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    x = torch.randn(21, 4, 16)
    angles = rotary.angles(torch.arange(21)[:, None], x.dtype)
    want = rotary(x.clone().requires_grad_(), angles).detach()
    with torch.no_grad():
        assert rotary(x, angles, paths.training.in_place) is not x
        with _LogitRows(16) as probe:  # head vectors: tensors 16 wide
            got = rotary(x, angles, paths.score.in_place)
    assert got is x and torch.equal(got, want)
    assert probe.rows <= 8 * 4  # a chunk of 8 rows of 4 heads


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_worker_results_with_rope_in_place_are_unchanged(tmp_path, monkeypatch, packed):
    """get_logprobs and top-k with RoPE in place (every forward of more than 8 tokens) equal
    those without: nothing reads megatron's queries and keys after attention."""
    from policyworker.model.attention import rotary

    folder = make_hf_model(tmp_path / "m", "llama")
    data = make_batch(batch=4, seq=24)
    packing = SequencePackingConfig(enabled=packed, train_mb_tokens=48, logprob_mb_tokens=48)
    worker = make_worker(folder, sequence_packing=packing)
    out = {}
    for rows in (10**9, 8):
        monkeypatch.setattr(rotary, "IN_PLACE_ROWS", rows)
        topk = worker.get_topk_logits(data=data, k=3)
        out[rows] = (worker.get_logprobs(data=data)["logprobs"], topk["topk_logits"])
    worker.shutdown()
    for a, b in zip(out[10**9], out[8], strict=True):
        assert torch.equal(a, b)
