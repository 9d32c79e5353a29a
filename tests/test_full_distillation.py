"""Full-vocabulary on-policy distillation, the student's side (#29): the reverse KL against a
teacher's full payload (hidden states through the teacher's LM head, or logits), the teacher
LM-head shards and their lifecycle."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import make_batch, make_hf_model

from policyworker import MegatronPolicyWorker
from policyworker.config import PolicyConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.data.contract import BatchValidationError
from policyworker.losses import FullDistillationConfig, FullDistillationLoss
from policyworker.ops.kl import TeacherRows, reverse_kl
from policyworker.ops.logprobs import Head, LogitOptions

PAYLOAD = "teacher_full_payload"


def _brute_kl(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    ls = torch.log_softmax(student / t, dim=-1)
    lt = torch.log_softmax(teacher / t, dim=-1)
    return (ls.exp() * (ls - lt)).sum(-1)


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
@pytest.mark.parametrize("source", ["hidden", "logits", "two-teachers"])
def test_op_value_and_gradient_equal_brute_force(chunk, source):
    """fp64: KL [B, S] and its gradients for the hidden states and the output layer equal
    autograd through a full-vocabulary log-softmax, chunked or not, for every teacher source."""
    g = torch.Generator().manual_seed(0)
    b, s, h, v, ht, t = 2, 5, 8, 13, 6, 0.7
    hidden = torch.randn(b, s, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    payload = torch.randn(b * s, ht, dtype=torch.float64, generator=g)
    heads = [torch.randn(v, ht, dtype=torch.float64, generator=g) for _ in range(2)]
    which = torch.randint(0, 2, (b * s,), generator=g)
    if source == "hidden":
        rows, teacher = TeacherRows(payload, (heads[0],)), payload @ heads[0].T
    elif source == "logits":
        rows, teacher = TeacherRows(payload @ heads[0].T), payload @ heads[0].T
    else:
        rows = TeacherRows(payload, tuple(heads), which)
        teacher = torch.where(which[:, None] == 0, payload @ heads[0].T, payload @ heads[1].T)
    upstream = torch.randn(b, s, dtype=torch.float64, generator=g)
    want = _brute_kl(hidden @ weight.T, teacher.reshape(b, s, v), t)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    opts = LogitOptions(temperature=t, tp_group=None, vocab_size=v, chunk_tokens=chunk)
    got = reverse_kl(Head(hidden, weight), rows, opts)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    assert (got - want).abs().max().item() < 1e-12
    for a, e in zip(got_grads, want_grads, strict=True):
        assert (a - e).abs().max().item() < 1e-12


def test_op_ignores_the_output_layers_padding_rows():
    """Rows past the true vocabulary (TP padding) count on neither side."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 3, 4, dtype=torch.float64, generator=g)
    weight = torch.randn(8, 4, dtype=torch.float64, generator=g)  # 6 real + 2 padding rows
    teacher = torch.randn(3, 9, dtype=torch.float64, generator=g)  # a larger teacher vocab
    opts = LogitOptions(temperature=1.0, tp_group=None, vocab_size=6)
    got = reverse_kl(Head(hidden, weight), TeacherRows(teacher), opts)
    want = _brute_kl((hidden @ weight.T)[..., :6], teacher[None, :, :6], 1.0)
    assert (got - want).abs().max().item() < 1e-12


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny llama (same vocabulary, other hidden size and weights)."""
    return make_hf_model(tmp_path_factory.mktemp("teacher"), "llama", seed=7, hidden_size=48)


def _hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _hf_loss(student, teacher_dir, data, t):
    """The loss in plain torch on the HF models: full-vocabulary reverse KL per position,
    masked by token_mask[:, 1:] * sample_mask, over the batch's valid tokens."""
    ids, lengths = data["input_ids"], data["input_lengths"]
    attn = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        teacher = _hf(teacher_dir)(ids, attention_mask=attn).logits
    kl = _brute_kl(student(ids, attention_mask=attn).logits, teacher, t)[:, :-1]
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return (kl * mask).sum() / mask.sum()


def _payload(teacher_dir, data, kind):
    """The teacher's payload, as its worker returns it."""
    cfg = PolicyConfig(model_name=str(teacher_dir), precision="float32", logprob_batch_size=2)
    teacher = MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
    out = teacher.get_logprobs_with_full_payload(data=data, payload=kind, payload_dtype="float32")
    return out[PAYLOAD]


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_loss_and_gradient_equal_transformers_for_both_payloads(llama_dir, teacher_dir, packed):
    """fp32: eval loss and the step's gradient norm equal plain torch on the HF models; the
    hidden-state and logits payloads give the same loss (packed and chunked alike)."""
    t, data = 0.8, make_batch(batch=4, seq=12)
    student_hf = _hf(llama_dir)
    want = _hf_loss(student_hf, teacher_dir, data, t)
    want.backward()
    grads = [p.grad for p in student_hf.parameters() if p.grad is not None]
    want_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    cfg = dict(temperature=t, logprob_chunk_size=5, max_grad_norm=0.0)
    if packed:
        cfg["sequence_packing"] = dict(enabled=True, train_mb_tokens=24, logprob_mb_tokens=24)
    losses = {}
    for kind in ("hidden_states", "logits"):
        student = make_worker(llama_dir, **cfg)
        if kind == "hidden_states":
            assert student.load_opd_full_teacher_lm_head({"model_name": str(teacher_dir)}, 0) == (
                str(teacher_dir)
            )
        batch = BatchedDataDict(data)
        batch[PAYLOAD] = _payload(teacher_dir, data, kind)
        loss_fn = FullDistillationLoss(FullDistillationConfig(payload=kind))
        losses[kind] = student.train(batch, loss_fn, eval_mode=True)["loss"]
        step = student.train(batch, loss_fn)
        assert step["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
        assert step["reverse_kl"] == pytest.approx(want.item(), rel=1e-5)
    assert losses["hidden_states"] == pytest.approx(want.item(), rel=1e-5)
    assert losses["logits"] == pytest.approx(losses["hidden_states"], rel=1e-6)


def test_self_distillation_has_no_kl(llama_dir):
    """The student distilled from its own payload: KL <= 1e-6, for both payloads."""
    data = make_batch(batch=4, seq=12)
    student = make_worker(llama_dir, temperature=0.7)
    student.load_opd_full_teacher_lm_head(str(llama_dir), 3)
    for kind in ("hidden_states", "logits"):
        batch = BatchedDataDict(data)
        batch[PAYLOAD] = student.get_logprobs_with_full_payload(
            data=data, payload=kind, payload_dtype="float32"
        )[PAYLOAD]
        loss_fn = FullDistillationLoss(FullDistillationConfig(payload=kind))
        assert abs(student.train(batch, loss_fn, eval_mode=True)["loss"]) <= 1e-6


def test_two_teachers_by_teacher_index(llama_dir, teacher_dir, tmp_path):
    """With two heads loaded, each row takes its `teacher_index`'s head: the loss over a batch
    mixing them is the sum of each teacher's rows alone."""
    other = make_hf_model(tmp_path / "other", "llama", seed=9, hidden_size=48)
    data = make_batch(batch=4, seq=12)
    student = make_worker(llama_dir)
    student.load_opd_full_teacher_lm_head(str(teacher_dir), 0)
    student.load_opd_full_teacher_lm_head(str(other), 5)
    # the payload: rows 0, 1 are the first teacher's hidden states, rows 2, 3 the other's
    first, second = (
        _payload(teacher_dir, data, "hidden_states"),
        _payload(other, data, "hidden_states"),
    )
    batch = BatchedDataDict(data)
    batch[PAYLOAD] = torch.cat([first[:2], second[2:]])
    batch["teacher_index"] = torch.tensor([0, 0, 5, 5])
    loss_fn = FullDistillationLoss(FullDistillationConfig(payload="hidden_states"))
    mixed = student.train(batch, loss_fn, eval_mode=True)
    # each teacher's rows alone (the other rows masked), renormalized to the whole batch's tokens
    parts = 0.0
    for rows, index in (([0, 1], 0), ([2, 3], 5)):
        alone = BatchedDataDict(batch)
        alone["teacher_index"] = torch.full((4,), index)
        keep = torch.zeros(4)
        keep[rows] = 1
        alone["sample_mask"] = keep
        m = student.train(alone, loss_fn, eval_mode=True)
        parts += m["loss"] * m["global_valid_toks"]
    assert mixed["loss"] * mixed["global_valid_toks"] == pytest.approx(parts, rel=1e-5)


@pytest.mark.parametrize("lifecycle", ["none", "offload", "evict"])
def test_lifecycle_follows_the_memory_phases(llama_dir, teacher_dir, lifecycle):
    """Outside training the shards stay, go to the host or are dropped; a train step brings
    them back (an evicted one re-read from the teacher's folder) with the same numbers."""
    data = make_batch(batch=4, seq=12)
    data[PAYLOAD] = _payload(teacher_dir, data, "hidden_states")
    student = make_worker(llama_dir, opd_full_teacher_lm_head_lifecycle=lifecycle)
    student.load_opd_full_teacher_lm_head(str(teacher_dir), 0)
    heads = student.trainer.teachers
    loss_fn = FullDistillationLoss()
    before = student.train(data, loss_fn, eval_mode=True)["loss"]
    student.offload_after_refit()
    assert heads.where() == {
        0: {"none": "device", "offload": "host", "evict": "evicted"}[lifecycle]
    }
    student.prepare_for_lp_inference(keep_train_buffers=True)  # keeps what it has
    student.prepare_for_training()
    assert student.train(data, loss_fn, eval_mode=True)["loss"] == before
    assert heads.where() == {0: "device"}


def test_bad_teacher_and_batches_are_refused(llama_dir, teacher_dir, tmp_path):
    """A clear error of its own, and nothing changes: no head yet, a smaller vocabulary, a
    second hidden size, a payload of the wrong width or with NaN, a missing teacher_index."""
    data = make_batch(batch=4, seq=12)
    student = make_worker(llama_dir)
    loss_fn = FullDistillationLoss()
    batch = BatchedDataDict(data)
    batch[PAYLOAD] = _payload(teacher_dir, data, "hidden_states")
    with pytest.raises(ValueError, match="load_opd_full_teacher_lm_head"):
        student.train(batch, loss_fn)
    small = make_hf_model(tmp_path / "small", "llama", vocab_size=50)
    with pytest.raises(ValueError, match="vocabulary"):
        student.load_opd_full_teacher_lm_head(str(small), 0)
    with pytest.raises(ValueError, match="teacher_path_config"):
        student.load_opd_full_teacher_lm_head(42, 0)
    with pytest.raises(ValueError, match="teacher_index"):
        student.load_opd_full_teacher_lm_head(str(teacher_dir), -1)
    student.load_opd_full_teacher_lm_head(str(teacher_dir), 0)
    with pytest.raises(ValueError, match="hidden size"):
        student.load_opd_full_teacher_lm_head(str(llama_dir), 1)  # hidden 64, not 48
    assert student.trainer.teachers.indices == [0]
    weights = {k: v.clone() for k, v in student.export_hf_weights()}
    wide = BatchedDataDict(batch)
    wide[PAYLOAD] = torch.zeros(4, 12, 64)
    nan = BatchedDataDict(batch)
    nan[PAYLOAD] = batch[PAYLOAD].clone()
    nan[PAYLOAD][0, 0, 0] = float("nan")
    narrow_logits = BatchedDataDict(batch)
    narrow_logits[PAYLOAD] = torch.zeros(4, 12, 100)
    cases = [(wide, loss_fn, "D = 48"), (nan, loss_fn, "finite"),
             (narrow_logits, FullDistillationLoss(FullDistillationConfig(payload="logits")), "D >= 101")]  # fmt: skip
    for bad, fn, match in cases:
        with pytest.raises(BatchValidationError, match=match):
            student.train(bad, fn)
    student.load_opd_full_teacher_lm_head(str(teacher_dir), 2)
    with pytest.raises(BatchValidationError, match="teacher_index"):
        student.train(batch, loss_fn)
    after = dict(student.export_hf_weights())
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    with pytest.raises(ValueError, match="payload"):
        FullDistillationConfig(payload="probs")  # type: ignore[arg-type]
