"""Every bad input raises ValueError naming the field, and leaves the worker usable and unchanged."""

import pytest
import torch
from conftest import make_worker
from helpers import make_batch, make_hf_model

from policyworker.config import OptimizerConfig, ParallelConfig, PolicyConfig, RefitConfig
from policyworker.losses import ClippedPGLoss, DistillationLoss, NLLLoss
from policyworker.model.hf_config import UnsupportedModelError


def _drop(key):
    def f(d):
        del d[key]

    return f


def _set(key, value):
    def f(d):
        d[key] = value(d) if callable(value) else value

    return f


def _set_at(key, value):
    def f(d):
        d[key] = d[key].clone()
        d[key][1, 5] = value

    return f


def _nan_at(key):
    return _set_at(key, float("nan"))


def _past_length(d):
    """A mask of 1 at a padding position: counted, it made padded and packed runs disagree."""
    d["token_mask"] = d["token_mask"].clone()
    d["token_mask"][1, int(d["input_lengths"][1])] = 1.0


def _too_long(d):
    """A row of 65 tokens (the context is 64): the rows' lengths are judged, not the width."""
    d["input_ids"] = torch.zeros(4, 65, dtype=torch.long)
    d["input_lengths"] = torch.tensor([65, 3, 3, 3])


BAD_BATCHES = {
    "missing input_ids": (_drop("input_ids"), "input_ids"),
    "missing advantages": (_drop("advantages"), "advantages"),
    "float input_ids": (_set("input_ids", lambda d: d["input_ids"].float()), "input_ids"),
    "1-D input_ids": (_set("input_ids", lambda d: d["input_ids"][0]), "input_ids"),
    "token id out of vocab": (_set("input_ids", lambda d: d["input_ids"] + 1000), "input_ids"),
    "negative token id": (_set("input_ids", lambda d: d["input_ids"] - 1000), "input_ids"),
    "too long": (_too_long, "max_total_sequence_length"),
    "length 0": (_set("input_lengths", torch.tensor([0, 3, 3, 3])), "input_lengths"),
    "length > S": (_set("input_lengths", torch.tensor([13, 3, 3, 3])), "input_lengths"),
    "float lengths": (_set("input_lengths", torch.tensor([3.0, 3, 3, 3])), "input_lengths"),
    "lengths wrong shape": (_set("input_lengths", torch.tensor([3, 3])), "input_lengths"),
    "token_mask wrong shape": (_set("token_mask", torch.ones(4, 11)), "token_mask"),
    "sample_mask wrong shape": (_set("sample_mask", torch.ones(4, 1)), "sample_mask"),
    "advantages NaN": (_set("advantages", lambda d: d["advantages"] * float("nan")), "advantages"),
    "int logprobs": (_set("prev_logprobs", lambda d: d["prev_logprobs"].long()), "prev_logprobs"),
    "uint8 input_ids": (_set("input_ids", lambda d: d["input_ids"].to(torch.uint8)), "input_ids"),
    "int16 lengths": (
        _set("input_lengths", lambda d: d["input_lengths"].to(torch.int16)),
        "input_lengths",
    ),
    "negative sample_mask": (_set("sample_mask", torch.tensor([1.0, -1, 1, 1])), "sample_mask"),
    "token_mask above 1": (_set("token_mask", lambda d: d["token_mask"] * 2), "token_mask"),
    "token_mask past the length": (_past_length, "token_mask.*past each row's input_lengths"),
    "prev_logprobs NaN": (_nan_at("prev_logprobs"), "prev_logprobs"),
    "prev_logprobs -inf": (_set_at("prev_logprobs", float("-inf")), "prev_logprobs"),
    "generation_logprobs NaN": (_nan_at("generation_logprobs"), "generation_logprobs"),
    "generation_logprobs +inf": (_set_at("generation_logprobs", float("inf")), "generation"),
    "reference NaN": (_nan_at("reference_policy_logprobs"), "reference_policy_logprobs"),
    "advantages inf": (_set_at("advantages", float("inf")), "advantages"),
    "not a dict": (None, "BatchedDataDict"),
}


@pytest.fixture(scope="module")
def worker(llama_dir):
    return make_worker(llama_dir)


# get_logprobs reads only input_ids and input_lengths.
TRAIN_ONLY = {
    "missing advantages",
    "token_mask wrong shape",
    "sample_mask wrong shape",
    "advantages NaN",
    "int logprobs",
    "negative sample_mask",
    "token_mask above 1",
    "token_mask past the length",
    "prev_logprobs NaN",
    "prev_logprobs -inf",
    "generation_logprobs NaN",
    "generation_logprobs +inf",
    "reference NaN",
    "advantages inf",
}
CALLS = [("train", c) for c in sorted(BAD_BATCHES)] + [
    ("get_logprobs", c) for c in sorted(BAD_BATCHES) if c not in TRAIN_ONLY
]


@pytest.mark.parametrize("call,case", CALLS)
def test_bad_batch_raises_and_changes_nothing(worker, case, call):
    mutate, field = BAD_BATCHES[case]
    data = make_batch(batch=4, seq=12)
    if mutate is None:
        data = [1, 2, 3]
    else:
        mutate(data)
    before = {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}
    steps = worker.state.scheduler.num_steps
    with pytest.raises(ValueError, match=field):
        if call == "train":
            worker.train(data, ClippedPGLoss())
        else:
            worker.get_logprobs(data=data)
    assert all(torch.equal(before[n], p) for n, p in worker.state.model.named_parameters())
    assert worker.state.scheduler.num_steps == steps
    # still usable
    assert worker.train(make_batch(batch=4, seq=12), NLLLoss(), eval_mode=True)["loss"] > 0


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"gbs": 3}, "gbs"),
        ({"gbs": 4, "mbs": 3}, "gbs"),
        ({"mbs": 0}, "mbs"),
        ({"gbs": 8}, "batch size"),
    ],
)
def test_bad_batch_sizes(worker, kwargs, field):
    with pytest.raises(ValueError, match=field):
        worker.train(make_batch(batch=4, seq=12), NLLLoss(), **kwargs)


def test_bad_call_arguments(worker):
    data = make_batch(batch=2, seq=8)
    with pytest.raises(ValueError, match="k"):
        worker.get_topk_logits(data=data, k=0)
    with pytest.raises(ValueError, match="k"):
        worker.get_topk_logits(data=data, k=10_000)
    with pytest.raises(ValueError, match="micro_batch_size"):
        worker.get_logprobs(data=data, micro_batch_size=-1)
    lr = worker.state.optimizer.param_groups[0]["lr"]
    for bad in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="lr"):
            worker.set_learning_rate(bad)
    assert worker.state.optimizer.param_groups[0]["lr"] == lr
    with pytest.raises(ValueError, match="refit_timeout_s"):
        worker.stream_weights_via_ipc_zmq(refit_timeout_s=float("inf"))
    empty = make_batch(batch=4, seq=12)
    empty["teacher_topk_logits"] = empty["teacher_topk_logits"][..., :0]
    empty["teacher_topk_indices"] = empty["teacher_topk_indices"][..., :0]
    with pytest.raises(ValueError, match="teacher_topk_logits"):
        worker.train(empty, DistillationLoss())


def test_unsupported_architecture_lists_supported(tmp_path):
    folder = make_hf_model(tmp_path, "llama")
    cfg = (folder / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (folder / "config.json").write_text(cfg)
    with pytest.raises(
        UnsupportedModelError,
        match=r"LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM",
    ):
        make_worker(folder)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ],
)
def test_unsupported_model_options(tmp_path, overrides, match):
    folder = make_hf_model(tmp_path, "llama", **overrides)
    with pytest.raises(UnsupportedModelError, match=match):
        make_worker(folder)


def test_sliding_window_shorter_than_sequences_is_refused(tmp_path):
    folder = make_hf_model(tmp_path, "mistral", sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        make_worker(folder)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"precision": "fp16"}, "precision"),
        ({"train_micro_batch_size": 3}, "train_global_batch_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"logprob_batch_size": 0}, "logprob_batch_size"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
        ({"seed": 10**23}, "seed"),
        ({"optimizer": OptimizerConfig(lr=float("inf"))}, "optimizer.lr"),
        ({"optimizer": OptimizerConfig(lr=float("nan"))}, "optimizer.lr"),
        ({"optimizer": OptimizerConfig(eps=float("inf"))}, "optimizer.eps"),
        ({"optimizer": OptimizerConfig(weight_decay=float("nan"))}, "optimizer.weight_decay"),
        ({"optimizer": OptimizerConfig(betas=(0.9, float("nan")))}, "optimizer.betas"),
        ({"refit": RefitConfig(timeout_s=float("inf"))}, "refit.timeout_s"),
        ({"parallel": {"tensor_model_parallel": 2}}, "parallel.tensor_model_parallel: unknown"),
        ({"parallel": {"context_parallel_size": 0}}, "parallel.context_parallel_size"),
        ({"optimizer": 1e-5}, "optimizer: expected OptimizerConfig or a mapping"),
    ],
)
def test_bad_config_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyConfig(model_name="/x", **kwargs)


def test_sub_configs_may_be_given_as_dicts():
    cfg = PolicyConfig(model_name="/x", parallel={"tensor_model_parallel_size": 2})
    assert cfg.parallel == ParallelConfig(tensor_model_parallel_size=2)


@pytest.mark.parametrize(
    "parallel,field",
    [
        ({"tensor_model_parallel_size": 3}, "tensor_model_parallel_size.*num_attention_heads=4"),
        ({"pipeline_model_parallel_size": 3}, "pipeline_model_parallel_size.*num_layers=2"),
        ({"context_parallel_size": 2}, r"tp\*pp\*cp = 1\*1\*2"),
        ({"expert_model_parallel_size": 2}, "expert_model_parallel_size"),
        ({"pipeline_model_parallel_size": 2}, "world size 1"),  # splits the model, not the world
    ],
)
def test_bad_parallel_layout(llama_dir, parallel, field):
    with pytest.raises(ValueError, match=field):
        make_worker(llama_dir, parallel=ParallelConfig(**parallel))


def test_a_config_changed_after_the_worker_was_built_is_refused(llama_dir):
    """`w.cfg.generation.top_p = 1.7` reached the sampler unchecked; `w.cfg.temperature = -1`
    acted nowhere (the services took it at build) — a change would act in some places and not
    in others. The next call refuses it by name; put back, the worker goes on."""
    worker = make_worker(llama_dir)
    data = make_batch(batch=4, seq=12)
    prompts = {"input_ids": data["input_ids"], "input_lengths": data["input_lengths"] // 2}
    worker.cfg.generation.top_p = 1.7
    with pytest.raises(ValueError, match=r"generate: cfg\.generation\.top_p changed .*1\.7"):
        worker.generate(data=prompts)
    worker.cfg.generation.top_p = 1.0
    worker.cfg.temperature = -1.0
    with pytest.raises(ValueError, match=r"get_logprobs: cfg\.temperature changed"):
        worker.get_logprobs(data=data)
    worker.cfg.temperature = 1.0
    assert worker.get_logprobs(data=data)["logprobs"].shape == (4, 12)
