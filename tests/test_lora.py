"""LoRA (`model/lora.py`, `peft` config, issue #55, first part): adapters on a frozen base —
a fresh one leaves the base bit for bit, training moves only the adapters, the reference policy
is the base itself, the merged weights export (and refit) as a model transformers scores as we
do, and the adapters' gradients are the merged weights' gradients through B and A."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import hf_logprobs, make_batch, make_hf_model
from test_moe import _hf_grads

from policyworker.config import OptimizerConfig, ParallelConfig, PeftConfig, as_policy_config
from policyworker.losses import NLLLoss
from policyworker.model.build import global_named_parameters
from policyworker.model.hf_config import model_shape
from policyworker.model.layout_checks import check_peft
from policyworker.model.weights import SafetensorsReader, mappings

LORA = {"enabled": True, "dim": 4, "alpha": 8}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("lora") / "m", "qwen3")


def test_adapters_train_on_a_frozen_base_whose_reference_is_the_base(folder, tmp_path):
    data = make_batch(batch=4, seq=12)
    base = make_worker(folder).get_logprobs(data=data)["logprobs"]
    worker = make_worker(folder, peft=LORA, optimizer=OptimizerConfig(lr=1e-2))
    assert torch.equal(worker.get_logprobs(data=data)["logprobs"], base)  # B = 0
    params = dict(worker.state.model.named_parameters())
    adapters = {n for n in params if ".adapter." in n}
    assert len(adapters) == 2 * 4 * 2  # 2 layers x qkv, proj, fc1, fc2 x (A, B)
    assert all(p.requires_grad == (n in adapters) for n, p in params.items())
    before = {n: p.detach().clone() for n, p in params.items()}
    losses = [worker.train(data, NLLLoss())["loss"] for _ in range(3)]
    assert losses[2] < losses[0]
    moved = {n for n, p in params.items() if not torch.equal(p, before[n])}
    assert moved == adapters  # the base bit for bit
    ours = worker.get_logprobs(data=data)["logprobs"]
    assert (ours - base).abs().max() > 1e-2
    reference = worker.get_reference_policy_logprobs(data=data)["reference_logprobs"]
    assert torch.equal(reference, base)  # the adapters off: no copy of the weights
    assert worker.state.reference is not None and not hasattr(worker.state.reference, "_weights")
    out = worker.save_hf_pretrained(tmp_path / "merged")  # W + s B A under the base's names
    assert (hf_logprobs(out, data) - ours).abs().max() <= 1e-5
    assert all(torch.equal(p, before[n]) for n, p in params.items() if n not in adapters)
    info = worker.prepare_refit_info()  # a refit sends the same merged weights
    assert not any("adapter" in n for n in info)


def test_adapter_gradients_are_the_merged_weights_gradients_through_b_and_a(folder, tmp_path):
    """With B drawn (not zero), the worker's gradients of A and B equal s · Bᵀ G and s · G Aᵀ,
    G transformers' gradient of the same loss at the merged weights (fp32)."""
    peft = LORA | {"lora_B_init_method": "normal", "target_modules": ["q_proj", "down_proj"]}
    worker = make_worker(folder, peft=peft, train_global_batch_size=4, train_micro_batch_size=2)
    data = make_batch(batch=4, seq=12)
    merged = worker.save_hf_pretrained(tmp_path / "merged")
    want_grads = _hf_grads(merged, data)
    worker.begin_train_step(NLLLoss(), gbs=4, mbs=2)
    worker.train_microbatch(data)
    params = global_named_parameters(worker.state.model)
    shape = model_shape(transformers.AutoConfig.from_pretrained(folder))
    table = {m.mcore: m for m in mappings(shape)}
    scale, compared = 8 / 4, 0
    for name, a in params.items():
        if not name.endswith(".adapter.lora_A"):
            continue
        base = name.removesuffix(".adapter.lora_A") + ".weight"
        b = params[name.removesuffix("lora_A") + "lora_B"]
        m = table[base]
        g = m.to_mcore([want_grads[n] for n in m.hf], shape)
        for got, want in ((a.main_grad, scale * b.T @ g), (b.main_grad, scale * g @ a.T)):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name
        compared += 1
    worker.abort_train_step()
    assert compared == 4  # linear_qkv and linear_fc2 of both layers
    assert SafetensorsReader(merged).names() == SafetensorsReader(folder).names()


def test_targets_by_either_name_and_what_is_not_built_is_refused(folder):
    peft = PeftConfig(enabled=True, target_modules=["q_proj", "linear_fc2"], exclude_modules=[])
    assert peft.modules() == {"linear_qkv", "linear_fc2"}
    assert PeftConfig(exclude_modules=["o_proj", "linear_fc1"]).modules() == {
        "linear_qkv", "linear_fc2"
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"peft\.target_modules: expected names of"):
        PeftConfig(target_modules=["qproj"]).validate()
    shape = model_shape(transformers.AutoConfig.from_pretrained(folder))
    with pytest.raises(ValueError, match="tensor_model_parallel_size: expected 1 with peft"):
        check_peft(PeftConfig(enabled=True), ParallelConfig(tensor_model_parallel_size=2), shape)
    moe = model_shape(transformers.AutoConfig.from_pretrained(make_moe(folder.parent)))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_peft(PeftConfig(enabled=True), ParallelConfig(), moe)
    recipe = {"model_name": str(folder), "megatron_cfg": {"enabled": True, "peft": {
        "enabled": True, "dim": 8, "alpha": 16, "target_modules": ["linear_qkv"]}}}  # fmt: skip
    assert as_policy_config(recipe).peft == PeftConfig(
        enabled=True, dim=8, alpha=16, target_modules=["linear_qkv"]
    )


def make_moe(parent):
    return make_hf_model(parent / "moe", "qwen3_moe")


def test_a_checkpoint_resumes_the_adapters_and_their_adam_state_exactly(folder, tmp_path):
    """Saved after a step (the whole model and the adapters' optimizer state, for now), a fresh
    LoRA worker loads it and its next steps are the saved run's, bit for bit."""
    data = make_batch(batch=4, seq=12)
    kw = {"peft": LORA, "optimizer": OptimizerConfig(lr=1e-2)}
    worker = make_worker(folder, **kw)
    worker.train(data, NLLLoss())
    weights, optim = tmp_path / "ckpt" / "weights", tmp_path / "ckpt" / "optim"
    worker.save_checkpoint(weights_path=str(weights), optimizer_path=str(optim))
    ran = [worker.train(data, NLLLoss())["loss"] for _ in range(2)]
    resumed = make_worker(folder, **kw)
    resumed.load_checkpoint(str(weights), str(optim))
    assert [resumed.train(data, NLLLoss())["loss"] for _ in range(2)] == ran


def test_the_adapters_export_as_a_peft_folder_peft_loads_onto_the_base(folder, tmp_path):
    """After training, `save_peft_adapter` writes adapter_model.safetensors and
    adapter_config.json; `peft` puts them on the transformers base and scores as we do (fp32,
    1e-5): the fused layers' adapters split per HF layer (q/k/v, gate/up)."""
    from peft import PeftModel

    data = make_batch(batch=4, seq=12)
    worker = make_worker(folder, peft=LORA, optimizer=OptimizerConfig(lr=1e-2))
    for _ in range(2):
        worker.train(data, NLLLoss())
    out = worker.save_peft_adapter(tmp_path / "adapter")
    model = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), out
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits[:, :-1].float()
    want = logits.log_softmax(-1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    real = torch.arange(11)[None, :] < data["input_lengths"][:, None] - 1
    got = worker.get_logprobs(data=data)["logprobs"][:, 1:]
    assert (
        got - worker.get_reference_policy_logprobs(data=data)["reference_logprobs"][:, 1:]
    ).abs().max() > 1e-2
    assert ((got - want) * real).abs().max() <= 1e-5
    with pytest.raises(ValueError, match=r"needs peft\.enabled"):
        make_worker(folder).save_peft_adapter(tmp_path / "none")


def test_packing_recompute_and_memory_phases_keep_the_adapters_numbers(folder):
    """Packed, with full activation recompute (the adapters' hooks run again in the recompute)
    and across an offload and back, a LoRA model's logprobs and step equal the plain run's."""
    from policyworker.config import RecomputeConfig, SequencePackingConfig

    data = make_batch(batch=4, seq=14, lengths=[14, 5, 9, 12])
    peft = LORA | {"lora_B_init_method": "normal"}
    packing = SequencePackingConfig(enabled=True, logprob_mb_tokens=64, train_mb_tokens=64)
    runs = {
        "plain": make_worker(folder, peft=peft),
        "packed": make_worker(folder, peft=peft, sequence_packing=packing),
        "recompute": make_worker(folder, peft=peft, recompute=RecomputeConfig(activation_checkpointing=True)),
    }  # fmt: skip
    runs["plain"].offload_after_refit()
    runs["plain"].prepare_for_training()
    out = {
        k: (w.get_logprobs(data=data)["logprobs"], w.train(data, NLLLoss()))
        for k, w in runs.items()
    }
    want_lp, want = out["plain"]
    for name, (lp, metrics) in out.items():
        assert (lp - want_lp).abs().max() <= 1e-5, name
        assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
