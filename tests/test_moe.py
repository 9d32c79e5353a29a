"""Mixture-of-experts decoders from Hugging Face (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5,
DeepSeek-V3, gpt-oss; 8 experts, top-2):
logprobs, top-k and a loss's gradients equal transformers' (fp32), per-expert export that
transformers reloads, the fused expert layout read too, and the architectures refused by name."""

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import hf_logprobs, make_batch, make_hf_model
from safetensors.torch import load_file, save_file

from policyworker.config import OptimizerConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.losses import NLLLoss
from policyworker.model.hf_config import model_shape
from policyworker.model.router_rules import Sigmoid, Softmax

FAMILIES = {
    "qwen3_moe": {},  # qk-norm, renormalized top-k, a dense first layer (mlp_only_layers)
    "qwen3_moe-unnormalized": {"norm_topk_prob": False, "mlp_only_layers": []},
    "qwen2_moe": {},  # shared expert with a sigmoid gate, qkv bias, top-k not renormalized
    "qwen2_moe-sparse-step": {"decoder_sparse_step": 2, "num_hidden_layers": 4},
    "mixtral": {},
    "glm4_moe": {},  # sigmoid routing + expert bias, groups, shared experts, partial RoPE
    "deepseek_v3": {},  # multi-head latent attention, RoPE rows interleaved; 4 groups
    # Moonlight's and DeepSeek-V2-Lite's latent attention: one query projection, no query latent
    "deepseek_v3-no-query-latent": {"q_lora_rank": None},
    # sinks, sliding-window layers, biases, the clamped SwiGLU, experts fused on disk
    "gpt_oss": {},
}


def _model(tmp_path, case: str):
    arch = case.split("-")[0]
    return make_hf_model(tmp_path / case, arch, **FAMILIES[case])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_dir(request, tmp_path_factory):
    return _model(tmp_path_factory.mktemp("moe"), request.param)


def test_the_shape_reads_each_family(tmp_path):
    q3 = model_shape(transformers.AutoConfig.from_pretrained(_model(tmp_path, "qwen3_moe")))
    assert q3.moe is not None and q3.moe.layers == (False, True)
    assert (q3.moe.num_experts, q3.moe.top_k, q3.moe.expert_ffn_size) == (8, 2, 32)
    assert q3.moe.rule == Softmax(normalize=True) and q3.moe.shared_expert_ffn_size == 0
    q2 = model_shape(transformers.AutoConfig.from_pretrained(_model(tmp_path, "qwen2_moe")))
    assert q2.moe.shared_expert_ffn_size == 48 and q2.moe.rule == Softmax(normalize=False)
    assert q2.moe.shared_expert_gate
    sparse = _model(tmp_path, "qwen2_moe-sparse-step")
    assert model_shape(transformers.AutoConfig.from_pretrained(sparse)).moe.layers == (
        False,
        True,
        False,
        True,
    )
    mx = model_shape(transformers.AutoConfig.from_pretrained(_model(tmp_path, "mixtral")))
    assert mx.moe.rule == Softmax(normalize=True) and mx.moe.layers == (True, True)
    glm = model_shape(transformers.AutoConfig.from_pretrained(_model(tmp_path, "glm4_moe")))
    assert glm.moe.rule == Sigmoid(groups=2, group_topk=1, scale=1.5)
    assert glm.moe.layers == (False, True) and glm.moe.shared_expert_ffn_size == 32
    assert not glm.moe.shared_expert_gate and glm.arch.qkv_bias and glm.arch.qk_norm
    assert (glm.head_dim, glm.rotary_dim) == (32, 16)


def test_logprobs_and_topk_equal_transformers(moe_dir):
    assert_logprobs_and_topk_equal_transformers(moe_dir)


def assert_logprobs_and_topk_equal_transformers(folder) -> None:
    """fp32 logprobs and top-4 logits/indices of five rows (lengths 1-20) = transformers'."""
    worker = make_worker(folder, logprob_batch_size=2)
    data = make_batch(batch=5, seq=20, lengths=[20, 7, 13, 1, 16])
    ours = worker.get_logprobs(data=data)["logprobs"]
    ref = hf_logprobs(folder, data)
    assert (ours - ref).abs().max().item() <= 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        vals, idx = model(data["input_ids"]).logits.topk(4, dim=-1)
    out = worker.get_topk_logits(data=data, k=4)
    valid = torch.arange(20)[None, :] < data["input_lengths"][:, None]
    assert (out["topk_logits"] - vals * valid[..., None]).abs().max() <= 1e-5
    assert torch.equal(out["topk_indices"][valid], idx[valid])


def _hf_grads(folder, data) -> dict[str, torch.Tensor]:
    """Gradients of the masked tokens' summed NLL, per transformers parameter (in memory: fused
    experts)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids, mask = data["input_ids"], data["token_mask"]
    lengths = data["input_lengths"]
    attn = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    logits = model(ids, attention_mask=attn).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-(lp * mask[:, 1:]).sum()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_gradients_of_a_loss_equal_transformers(moe_dir, tmp_path):
    """The worker's gradients of a step's micro-batches (before the step normalizes them by the
    token count), exported through the HF mapping, against transformers' of the summed NLL."""
    worker = make_worker(moe_dir, train_global_batch_size=4, train_micro_batch_size=2)
    data = make_batch(batch=4, seq=12)
    ref = _hf_grads(moe_dir, data)
    grads = _worker_grads(worker, data)
    compared = 0
    for name, g in grads.items():
        want = _hf_rows(ref, name)
        scale = want.abs().max().clamp_min(1e-8)
        assert ((g - want).abs().max() / scale).item() <= 1e-5, name
        compared += 1
    assert compared == len(grads) and any(".experts." in n for n in grads)


def _worker_grads(worker, data: BatchedDataDict, mbs: int = 2) -> dict[str, torch.Tensor]:
    """HF-named gradients of the worker's NLLLoss on `data`, unnormalized (a split step opened,
    one chunk added, the step dropped)."""
    from policyworker.model.build import global_named_parameters
    from policyworker.model.weights import export_hf_weights

    worker.begin_train_step(NLLLoss(), gbs=4, mbs=mbs)
    worker.train_microbatch(data)
    params = global_named_parameters(worker.state.model)
    grads = {n: p.main_grad for n, p in params.items()}
    out = {n: g.clone() for n, g in export_hf_weights(grads, worker.shape)}
    worker.abort_train_step()
    return out


def _hf_rows(ref: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """transformers' gradient for an on-disk name (Mixtral's block renamed, fused experts sliced
    per expert)."""
    from policyworker.model.experts import transformers_view

    rows = transformers_view(ref, name)
    assert rows is not None, name
    return rows


def test_export_uses_per_expert_names_and_transformers_reloads_it(moe_dir, tmp_path):
    worker = make_worker(moe_dir)
    out = worker.save_hf_pretrained(tmp_path / "export")
    saved, source = load_file(out / "model.safetensors"), load_file(moe_dir / "model.safetensors")
    assert saved.keys() == source.keys()
    fused = "gpt_oss" in str(moe_dir)  # gpt-oss's checkpoints hold its experts fused
    assert fused == any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in saved)
    if fused:  # the interleaved gate/up columns, transposes and biases back as they were
        assert all(torch.equal(saved[n], source[n]) for n in saved if ".experts." in n)
    data = make_batch(batch=3, seq=10)
    torch.testing.assert_close(hf_logprobs(out, data), hf_logprobs(moe_dir, data))


def test_experts_stored_fused_load_the_same(tmp_path):
    folder = _model(tmp_path, "qwen3_moe")
    tensors = load_file(folder / "model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    layer = "model.layers.1.mlp.experts."
    gate_up = [torch.cat([tensors[f"{layer}{e}.gate_proj.weight"], tensors[f"{layer}{e}.up_proj.weight"]]) for e in range(8)]  # fmt: skip
    fused[layer + "gate_up_proj"] = torch.stack(gate_up)
    fused[layer + "down_proj"] = torch.stack([tensors[f"{layer}{e}.down_proj.weight"] for e in range(8)])  # fmt: skip
    save_file(fused, folder / "model.safetensors", metadata={"format": "pt"})
    data = make_batch(batch=2, seq=10)
    ours = make_worker(folder).get_logprobs(data=data)["logprobs"]
    assert (ours - hf_logprobs(folder, data)).abs().max().item() <= 1e-5


def _params(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.state.model.named_parameters()}


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path):
    """Qwen2-MoE (routed and shared experts): steps lower the loss; a checkpoint taken after one
    step resumes bit for bit, every expert's Adam moments included (none re-initialized)."""
    folder = _model(tmp_path, "qwen2_moe")
    data = make_batch(batch=4, seq=12)
    opt = OptimizerConfig(lr=1e-2)
    first = make_worker(folder, optimizer=opt)
    losses = [first.train(data, NLLLoss())["loss"]]
    first.save_checkpoint(tmp_path / "weights", tmp_path / "optim")
    saved = _expert_moments(first)
    losses += [first.train(data, NLLLoss())["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    resumed = make_worker(folder, optimizer=opt)
    resumed.load_checkpoint(tmp_path / "weights", tmp_path / "optim")
    loaded = _expert_moments(resumed)
    assert len(loaded) == len(saved) and any(m.abs().sum() > 0 for m in saved)
    assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))
    again = [resumed.train(data, NLLLoss())["loss"] for _ in range(3)]
    assert again == losses[1:]
    ours, theirs = _params(first), _params(resumed)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def _expert_moments(worker) -> list[torch.Tensor]:
    """Adam's moments of the routed experts (the optimizer's part of their own), in order."""
    from policyworker.train.optimizer import optimizer_parts

    _, experts = optimizer_parts(worker.state.optimizer)
    state = experts.optimizer.state
    return [state[p][k].clone() for g in experts.optimizer.param_groups for p in g["params"]
            for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip


@pytest.mark.parametrize("case", ["mixtral", "gpt_oss"])
def test_memory_phases_move_experts_and_bring_them_back_exactly(tmp_path, case):
    worker = make_worker(_model(tmp_path, case))
    worker.train(make_batch(batch=4, seq=12), NLLLoss())
    before = _params(worker)
    worker.offload_after_refit()
    assert all(p.device.type == "cpu" for p in worker.state.model.parameters())
    worker.prepare_for_training()
    after = _params(worker)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.processes
@pytest.mark.parametrize(
    ("case", "transport", "trainer", "receiver"),
    [
        ("mixtral", "collective", (1, 2, 1), (1, 1, 1)),
        # GLM-4.5: shared experts, a dense first layer and the expert bias beside the experts
        ("glm4_moe", "reshard", (1, 2, 1), (2, 1, 1)),
        ("mixtral", "reshard", (2, 1, 2), (1, 2, 1)),
        # latent attention's TP2 shards (and its whole down-projections) into one rank
        ("deepseek_v3", "reshard", (2, 1, 1), (1, 1, 1)),
        # gpt-oss's sinks split by heads, its biases and fused experts, TP2 into EP2
        ("gpt_oss", "reshard", (2, 1, 1), (1, 2, 1)),
    ],
)
def test_refit_check_on_an_moe_model(tmp_path, capsys, case, transport, trainer, receiver):
    """Every transport delivers per-expert weights bit for bit: into transformers' engine (whose
    experts are fused in memory: written through views) and into destination workers; from an
    expert-parallel trainer (each expert broadcast by the rank that holds it) and between EP
    layouts (reshard: each expert's pieces from its EP rank to the destinations' EP rank, cut
    along expert TP). `trainer` / `receiver`: (TP, EP, expert TP)."""
    import json

    from policyworker.tools import refit_check as check

    folder = _model(tmp_path, case)
    opts = check.CheckOptions(
        model=str(folder),
        transport=transport,
        trainer_tp=trainer[0],
        trainer_ep=trainer[1],
        trainer_etp=trainer[2],
        receiver_tp=receiver[0],
        receiver_ep=receiver[1],
        receiver_etp=receiver[2],
        refits=2,
    )
    assert check.main(opts) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["ok"] and row["weights_equal"] and row["weight_version"] == 2
    assert row["max_logprob_diff"] <= 1e-4


@pytest.mark.processes
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_the_demo_trains_each_new_family(tmp_path, family):
    """The main job on a user's DeepSeek-V3 folder (latent attention, sigmoid routers with the
    expert bias, shared experts, a dense first layer) and Qwen3.5 folder (Gated DeltaNet
    layers): SFT and GRPO steps through the driver, each GRPO step refitting transformers'
    engine (its fused experts written per expert). gpt-oss's refit into that engine:
    test_family_refit.py; the demo's code is the same for every family."""
    import json

    from policyworker.cli import main
    from policyworker.demo.task import char_tokenizer

    tokenizer = char_tokenizer()
    folder = make_hf_model(
        tmp_path / "moe", family, vocab_size=len(tokenizer), max_position_embeddings=64
    )
    tokenizer.save_pretrained(folder)
    data = tmp_path / "tasks.jsonl"
    rows = [json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(10)]
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    options = ["sft_steps=1", "grpo_steps=2", "prompts_per_step=4", "group_size=2"]
    options += ["micro_batch_size=8", "sft_batch=8", "max_sequence_length=32"]
    main(["demo", "--model", str(folder), "--data", str(data), "--out", str(out), *options])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in metrics] == ["sft", "grpo", "grpo"]
    assert [r["weight_version"] for r in metrics if r["phase"] == "grpo"] == [1, 2]
    assert (out / "hf" / "model.safetensors").exists()


def test_a_frozen_router_keeps_its_weights_and_the_rest_trains(tmp_path):
    from policyworker.config import MoEConfig

    folder = _model(tmp_path, "qwen3_moe")
    worker = make_worker(
        folder, optimizer=OptimizerConfig(lr=1e-2), moe=MoEConfig(freeze_moe_router=True)
    )
    before = _params(worker)
    worker.train(make_batch(batch=4, seq=12), NLLLoss())
    after = _params(worker)
    routers = [n for n in before if n.endswith("mlp.router.weight")]
    assert routers and all(torch.equal(before[n], after[n]) for n in routers)
    experts = [n for n in before if ".experts." in n]
    assert any(not torch.equal(before[n], after[n]) for n in experts)


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64"])
def test_router_dtype_keeps_logprobs_exact(tmp_path, router_dtype):
    from policyworker.config import MoEConfig

    folder = _model(tmp_path, "mixtral")
    worker = make_worker(folder, moe=MoEConfig(moe_router_dtype=router_dtype))
    router = worker.state.model.decoder.layers[0].mlp.router
    assert router.config.moe_router_dtype == router_dtype
    data = make_batch(batch=3, seq=12)
    ours = worker.get_logprobs(data=data)["logprobs"]
    assert (ours - hf_logprobs(folder, data)).abs().max().item() <= 1e-5


def test_moe_options_are_checked():
    from policyworker.config import MoEConfig, ParallelConfig

    with pytest.raises(ValueError, match=r"moe\.moe_router_dtype"):
        MoEConfig(moe_router_dtype="bf16").validate()
    with pytest.raises(ValueError, match=r"moe\.moe_token_dispatcher_type: expected alltoall or"):
        MoEConfig(moe_token_dispatcher_type="flex").validate()
    with pytest.raises(ValueError, match=r"parallel\.expert_tensor_parallel_size: expected an int"):
        ParallelConfig(expert_tensor_parallel_size=0).validate()


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral", "gpt_oss"])
def test_grouped_experts_equal_sequential_mlp(tmp_path, case):
    """The grouped-GEMM experts with their sync-free dispatcher, and megatron's SequentialMLP
    with megatron's: the same logprobs and gradients (fp32, CPU) on the same parameters; the
    modules are what the option says."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from policyworker.config import MoEConfig
    from policyworker.model.grouped_experts import GroupedExperts, LocalTokenDispatcher

    folder = _model(tmp_path, case)
    data = make_batch(batch=4, seq=12)
    out = {}
    for grouped in (True, False):
        worker = make_worker(folder, moe=MoEConfig(moe_grouped_gemm=grouped))
        experts = [m for m in worker.state.model.modules() if isinstance(m, SequentialMLP)]
        assert experts and all(isinstance(m, GroupedExperts) == grouped for m in experts)
        layers = [m for m in worker.state.model.modules() if isinstance(m, MoELayer)]
        assert all(isinstance(m.token_dispatcher, LocalTokenDispatcher) == grouped for m in layers)
        out[grouped] = (worker.get_logprobs(data=data)["logprobs"], _worker_grads(worker, data))
    (lp_g, grads_g), (lp_s, grads_s) = out[True], out[False]
    assert (lp_g - lp_s).abs().max().item() <= 1e-6
    for name, g in grads_g.items():
        scale = grads_s[name].abs().max().clamp_min(1e-8)
        assert ((g - grads_s[name]).abs().max() / scale).item() <= 1e-6, name


MOE_LAYOUTS = {  # (tp, pp, flags) on two ranks; megatron wants SP with TP; experts whole
    # (expert TP 1) unless "etp". PP2, DP2 and EP2 each run beside a feature, not alone: the
    # plain layouts' paths are those (split steps and packing only add to them)
    "tp2-sequence-parallel-seq-aux-loss": (2, 1, ("sp", "seqaux")),
    "dp2-packed-seq-aux-loss": (1, 1, ("pack", "seqaux")),
    "cp2-packed-seq-aux-loss": (1, 1, ("cp", "pack", "seqaux")),
    "pp2-split-step-replay": (1, 2, ("split", "replay")),
    "tp2-sequence-parallel-expert-tp2": (2, 1, ("sp", "etp")),
    "ep2-packed-distributed-optimizer-overlapped": (1, 1, ("ep", "pack", "distopt", "overlap")),
    "tp2-sequence-parallel-allgather-dispatcher": (2, 1, ("sp", "allgather")),
    "ep2-cp2-packed-chunked-replay": (1, 1, ("ep", "cp", "pack", "chunk", "replay")),
    "tp2-sequence-parallel-full-recompute-replay": (2, 1, ("sp", "recompute", "replay")),
    "cp2-packed-selective-recompute": (1, 1, ("cp", "pack", "selrecompute")),
}


@pytest.fixture(scope="module")
def moe_layouts(tmp_path_factory):
    """Qwen2-MoE (routed and shared experts, tied embeddings) on one rank (plain, with router
    replay, with a per-sequence load-balancing loss) and on every two-rank layout of
    `MOE_LAYOUTS` (one launch of tests/multirank.py)."""
    from test_parallel import VOCAB

    folder = make_hf_model(
        tmp_path_factory.mktemp("moe_tied"), "qwen2_moe", vocab_size=VOCAB, tie_word_embeddings=True
    )
    return _one_and_two_ranks(folder, MOE_LAYOUTS, tmp_path_factory.mktemp("moe_two_ranks"))


def _one_and_two_ranks(folder, layouts, out, **flags):
    """`folder`'s results on one rank — plain, with router replay, with a per-sequence
    load-balancing loss, each with `flags` (`multirank.config`) — and on every two-rank layout of
    `layouts` (one launch of tests/multirank.py, into `out`)."""
    from multirank import config, fixed_batch, layout_results
    from test_parallel import VOCAB, launch

    from policyworker.worker import MegatronPolicyWorker

    single = {  # by (router replay, a per-sequence load-balancing loss)
        (replay, seq_aux): layout_results(
            MegatronPolicyWorker(
                config(str(folder), tp=1, pp=1, replay=replay, seq_aux=seq_aux, **flags)
            ),
            fixed_batch(VOCAB),
        )
        for replay, seq_aux in ((False, False), (True, False), (False, True))
    }
    launch(folder, out, layouts, nproc=2)
    return folder, single, out


@pytest.mark.processes
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_layouts_match_one_rank(moe_layouts, layout):
    """logprobs, top-k, reference logprobs, two GRPO steps' loss and grad norm, the weights after
    them and their HF export: each two-rank layout of an MoE model gives the one-rank results."""
    _assert_layout_matches(moe_layouts, MOE_LAYOUTS, layout)


MOE_FOUR_RANKS = {  # expert parallel beside TP, DP and PP
    "ep2-tp2-sequence-parallel": (2, 1, ("sp", "ep")),
    "ep2-expert-tp2-tp2-sequence-parallel": (2, 1, ("sp", "ep", "etp")),
    "ep2-dp4": (1, 1, ("ep",)),
}


# The families' own attention and routers (test_glm.py, test_deepseek.py) beside EP2 x TP2 +
# SP, in the same launch: GLM-4.5's partial RoPE and q/k/v biases, DeepSeek-V3's latent
# attention without a query latent (its down-projection whole on every TP rank, its one query
# projection split by heads; with a query latent under TP2: test_deepseek.py); sigmoid routers
# moving their bias. Each layout's FAMILIES case is the longest one its name starts with.
FAMILY_FOUR_RANKS = {
    "glm4_moe-ep2-tp2-sequence-parallel-packed": (2, 1, ("sp", "ep", "pack", "bias")),
    "deepseek_v3-no-query-latent-ep2-tp2-sequence-parallel": (2, 1, ("sp", "ep", "bias")),
    # sinks split with the heads, biases under TP + SP, windows at packed positions
    "gpt_oss-ep2-tp2-sequence-parallel-packed": (2, 1, ("sp", "ep", "pack")),
    # its windows and sinks at CP positions, beside EP2 (DP2)
    "gpt_oss-ep2-cp2-packed-chunked": (1, 1, ("ep", "cp", "pack", "chunk")),
    # Gated DeltaNet layers split over TP2 (their key heads, one a rank) on both stages (3
    # linear layers, 1 full: 2 and 2), packed, EP2 over the TP ranks, split steps; a later
    # stage's routers get their sequence-parallel share of the padding mask (compat/router.py)
    # Gated DeltaNet under CP2: each layer's recurrence over the all-gathered sequences
    "qwen3_5_moe-ep2-cp2-packed-chunked": (1, 1, ("ep", "cp", "pack", "chunk")),
    "qwen3_5_moe-ep2-tp2-pp2-sequence-parallel-packed-split-step": (
        2,
        2,
        ("sp", "ep", "pack", "split"),
    ),
}


@pytest.fixture(scope="module")
def moe_four_ranks(moe_layouts, tmp_path_factory):
    """Qwen2-MoE on every layout of MOE_FOUR_RANKS and GLM-4.5 / DeepSeek-V3 on theirs (one
    launch); each family's one-rank results."""
    from multirank import config, fixed_batch, layout_results
    from test_parallel import VOCAB, launch

    from policyworker.worker import MegatronPolicyWorker

    folder, single, _ = moe_layouts
    out = tmp_path_factory.mktemp("moe_four_ranks")
    families = {}
    cases = FAMILIES | {"qwen3_5_moe": {}}  # Qwen3.5-MoE's own checks: test_qwen3_5.py
    for layout in FAMILY_FOUR_RANKS:
        case = max((c for c in cases if layout.startswith(c + "-")), key=len)
        own = make_hf_model(
            tmp_path_factory.mktemp(case), case.split("-")[0], vocab_size=VOCAB, **cases[case]
        )
        worker = MegatronPolicyWorker(config(str(own), tp=1, pp=1, bias=True))
        families[layout] = own, {(False, False): layout_results(worker, fixed_batch(VOCAB))}
    models = {name: own for name, (own, _) in families.items()}
    launch(folder, out, MOE_FOUR_RANKS | FAMILY_FOUR_RANKS, nproc=4, models=models)
    return (folder, single, out), {name: (*got, out) for name, got in families.items()}


@pytest.mark.processes
@pytest.mark.parametrize("layout", MOE_FOUR_RANKS)
def test_moe_expert_parallel_layouts_on_four_ranks_match_one_rank(moe_four_ranks, layout):
    """The same results with EP2 beside TP2 (experts whole, or split over expert TP), within
    four data-parallel ranks (two copies of each expert) and with two pipeline stages."""
    _assert_layout_matches(moe_four_ranks[0], MOE_FOUR_RANKS, layout)


@pytest.mark.processes
@pytest.mark.parametrize("layout", FAMILY_FOUR_RANKS)
def test_the_families_on_ep2_by_tp2_match_one_rank(moe_four_ranks, layout):
    _assert_layout_matches(moe_four_ranks[1][layout], FAMILY_FOUR_RANKS, layout)


def _assert_layout_matches(results, layouts, layout) -> None:
    from test_parallel import VOCAB, _assert_matches

    folder, singles, out = results
    tp, pp, flags = layouts[layout]
    single = singles["replay" in flags, "seqaux" in flags]
    got = torch.load(out / f"{layout}.pt", weights_only=False)
    assert (got["dims"].tp, got["dims"].pp) == (tp, pp)
    _assert_matches(got, single, folder, VOCAB, out / f"{layout}.hf", pp=pp)
    metrics = ROUTE_METRICS
    if "replay" in flags:  # the routes it chose are one rank's, and every step replayed them
        assert torch.equal(got["routes"], single["routes"])
        metrics += ("moe_replay_route_differs_fraction",)
    if "seqaux" in flags:  # the per-sequence balancing loss does not depend on the layout
        metrics += ("moe_aux_loss",)
    for step, want in enumerate(single["train"]):  # every token reached the same experts
        for rank_metrics in got["train"]:
            for key in metrics:
                rel = 1e-6 if key == "moe_aux_loss" else 1e-9  # a float sum; the rest counts
                assert rank_metrics[step][key] == pytest.approx(want[key], rel=rel), (step, key)


ROUTE_METRICS = (
    "moe_tokens_per_expert_min",
    "moe_tokens_per_expert_max",
    "moe_tokens_per_expert_cv",
)


@pytest.mark.parametrize("how", ["rows", "packed", "one-row-micro-batches", "split-step"])
def test_tokens_per_expert_count_every_real_token_once(tmp_path, how):
    """With top-k = every expert, each expert of each MoE layer receives each real token of the
    step exactly once: padding, packing gaps and the other micro-batches' fillers do not count,
    nor do forward-only calls."""
    from policyworker.config import SequencePackingConfig

    folder = make_hf_model(tmp_path / "m", "qwen3_moe", num_experts_per_tok=8)
    packing = SequencePackingConfig(enabled=how == "packed", train_mb_tokens=24)
    worker = make_worker(folder, sequence_packing=packing)
    data = make_batch(batch=4, seq=12)
    tokens = float(data["input_lengths"].sum())
    worker.get_logprobs(data=data)
    if how == "split-step":
        worker.begin_train_step(NLLLoss())
        worker.train_microbatch(data.slice(0, 2))
        worker.train_microbatch(data.slice(2, 4))
        metrics = worker.finish_train_step()
    else:
        metrics = worker.train(data, NLLLoss(), mbs=1 if how == "one-row-micro-batches" else None)
    assert metrics["moe_tokens_per_expert_min"] == metrics["moe_tokens_per_expert_max"] == tokens
    assert metrics["moe_tokens_per_expert_cv"] == 0.0


def test_layouts_an_moe_model_cannot_take_are_refused(tmp_path):
    from policyworker.config import MoEConfig, ParallelConfig
    from policyworker.model.layout_checks import check_layout

    shape = model_shape(transformers.AutoConfig.from_pretrained(_model(tmp_path, "mixtral")))
    dense = model_shape(transformers.AutoConfig.from_pretrained(make_hf_model(tmp_path / "d")))
    refused = [
        (ParallelConfig(tensor_model_parallel_size=2), shape, None,
         r"sequence_parallel: expected true for an MoE model"),
        (ParallelConfig(expert_model_parallel_size=3), shape, None,
         r"expert_model_parallel_size: expected a divisor of num_experts=8, got 3"),
        (ParallelConfig(expert_tensor_parallel_size=5), shape, None,
         r"expert_tensor_parallel_size: expected a divisor of the experts' intermediate"),
        (ParallelConfig(expert_model_parallel_size=2), shape,
         MoEConfig(moe_token_dispatcher_type="allgather"),
         r"moe_token_dispatcher_type: expected alltoall with .*expert_model_parallel_size=2"),
        (ParallelConfig(expert_model_parallel_size=2), dense, None,
         r"expert_model_parallel_size: expected 1 \(a dense model\), got 2"),
    ]  # fmt: skip
    for parallel, model, moe, match in refused:
        with pytest.raises(ValueError, match=match):
            check_layout(parallel, model, moe)
    check_layout(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), shape)
    check_layout(ParallelConfig(expert_model_parallel_size=8, expert_tensor_parallel_size=2), shape)


@pytest.mark.processes
def test_expert_parallel_checkpoints_resume_exactly_and_load_into_one_rank(tmp_path):
    """EP2 (each rank four of the eight experts, their Adam state its own): save, and a fresh
    EP2 run resumes bit for bit; one rank (EP1) loads the same checkpoint and continues within
    1e-5; an EP1 checkpoint loads into EP2 the same way. The same for DeepSeek-V3 under TP2 + SP
    (latent attention's whole-on-every-rank down-projections, its sigmoid routers' expert bias
    moving every step: GLM-4.5's are the same routers) and gpt-oss under TP2 + SP (its sinks
    split with the heads, its biases) in the same two launches."""
    from ckpt_multirank import paths, run_resume, run_save
    from multirank import config
    from test_checkpoint import _assert_bitwise, _assert_close, save_then_resume

    from policyworker.worker import MegatronPolicyWorker

    folder = make_hf_model(tmp_path / "m", "qwen3_moe", vocab_size=101)
    cfg = config(str(folder), tp=1, pp=1)
    one = tmp_path / "one"
    saved_one = run_save(MegatronPolicyWorker(cfg), one)
    families = {  # job -> (model, its one-rank config)
        "ep2": (folder, cfg),
        "deepseek_v3-tp2": (make_hf_model(tmp_path / "ds", "deepseek_v3", vocab_size=101), None),
    }
    oss = make_hf_model(tmp_path / "oss", "gpt_oss", vocab_size=101)
    families["gpt_oss-tp2"] = (oss, config(str(oss), tp=1, pp=1))
    jobs = {
        "ep2": {"model": folder, "tp": 1, "pp": 1, "flags": ["ep"]},
        "one-into-ep2": {"model": folder, "tp": 1, "pp": 1, "flags": ["ep"], "ckpt": one},
        "deepseek_v3-tp2": {"model": families["deepseek_v3-tp2"][0], "tp": 2, "pp": 1},
        "gpt_oss-tp2": {"model": oss, "tp": 2, "pp": 1, "flags": ["sp"]},  # sinks split
    }
    jobs["deepseek_v3-tp2"]["flags"] = ["sp", "bias"]
    runs = save_then_resume(jobs, tmp_path)
    _assert_close(saved_one, runs["one-into-ep2"]["resume"])
    for name, (model, one_rank) in families.items():
        saved, resumed = runs[name]["save"], runs[name]["resume"]
        _assert_bitwise(saved, resumed)
        _assert_bitwise(saved, {"lp_at_save": resumed["lp_at_save"], **resumed["async"]})
        weights, optim = paths(tmp_path / name, "sync")
        one_rank = one_rank or config(str(model), tp=1, pp=1, bias=True)
        single = MegatronPolicyWorker(
            one_rank, weights_path=str(weights), optimizer_path=str(optim)
        )
        _assert_close(saved, run_resume(single, tmp_path / name))
        single.shutdown()
