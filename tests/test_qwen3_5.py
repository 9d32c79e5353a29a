"""Qwen3.5 (dense and MoE): Gated DeltaNet linear-attention layers beside gated full attention, from
Hugging Face — the gated delta rule against transformers' reference implementation, logprobs,
top-k and a loss's gradients against transformers (fp32), packing, recompute, chunking, export;
what is not built yet is refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import HostReads, make_batch, make_hf_model
from test_moe import _hf_grads, _hf_rows, _worker_grads, assert_logprobs_and_topk_equal_transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from policyworker.config import ParallelConfig, RecomputeConfig, SequencePackingConfig
from policyworker.model.hf_config import DeltaNetShape, model_shape
from policyworker.model.layout_checks import check_layout
from policyworker.model.layouts import VocabRows
from policyworker.model.linear_attention import GatedDeltaNet
from policyworker.model.weights import SafetensorsReader, mappings
from policyworker.ops import gated_delta
from policyworker.refit.reshard import pieces


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("qwen3_5") / "m", "qwen3_5")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def each(request, folder, tmp_path_factory):
    """The dense model, Qwen3.5-MoE (Qwen2-MoE's experts in every layer, renormalized) and
    Qwen3-Next (the same layers, a dense first MLP, in-projections fused per key head)."""
    if request.param == "qwen3_5":
        return folder
    return make_hf_model(tmp_path_factory.mktemp(request.param) / "m", request.param)


def _inputs(b=2, s=150, h=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, s, h, dk, generator=g), torch.randn(b, s, h, dk, generator=g)
    v = torch.randn(b, s, h, dv, generator=g)
    decay = -torch.rand(b, s, h, generator=g) * 0.5
    return q, k, v, decay, torch.rand(b, s, h, generator=g)


def test_the_gated_delta_rule_is_transformers_reference_and_carries_its_state():
    """Chunked (150 tokens: two chunks and a padded third) and token by token, bitwise
    transformers' reference functions; a sequence split in two calls, the state handed over,
    gives the whole call's outputs and state; packed sequences each start from zero."""
    q, k, v, g, beta = _inputs()
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, state = gated_delta.chunked(q, k, v, g, beta)
    assert torch.equal(out, want) and torch.equal(state, want_state)
    step = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    rec, rec_state = gated_delta.recurrent(q, k, v, g, beta)
    assert torch.equal(rec, step[0]) and torch.equal(rec_state, step[1])
    assert (rec - out).abs().max() <= 1e-5  # the two forms of one recurrence
    cut = 70
    first, mid = gated_delta.chunked(*(x[:, :cut] for x in (q, k, v, g, beta)))
    second, last = gated_delta.chunked(*(x[:, cut:] for x in (q, k, v, g, beta)), initial=mid)
    assert (torch.cat([first, second], dim=1) - out).abs().max() <= 1e-5
    assert (last - state).abs().max() <= 1e-5
    row = [x[:1] for x in (q, k, v, g, beta)]  # one row holding two sequences
    packed = gated_delta.packed(*row, cu_seqlens=[0, cut, 150])
    alone = gated_delta.chunked(*(x[:, cut:] for x in row))[0]
    assert torch.equal(packed[:, :cut], gated_delta.chunked(*(x[:, :cut] for x in row))[0])
    assert torch.equal(packed[:, cut:], alone)


def test_the_shape_reads_the_hybrid_pattern_and_refuses_what_is_not_built(folder, tmp_path):
    shape = model_shape(transformers.AutoConfig.from_pretrained(folder))
    assert shape.linear_layers == (True, True, True, False)
    assert shape.delta_net == DeltaNetShape(2, 4, 16, 8, 4)
    assert shape.arch.output_gate and shape.arch.zero_centered_norm and shape.rotary_dim == 4
    check_layout(ParallelConfig(context_parallel_size=2), shape)  # sequences gathered per layer
    tp2 = ParallelConfig(tensor_model_parallel_size=2)
    check_layout(tp2, shape)  # TP splits the key heads, and the value heads that read them
    one_key_head = dataclasses.replace(shape, delta_net=DeltaNetShape(1, 4, 16, 8, 4))
    with pytest.raises(ValueError, match="divisor of linear_num_key_heads=1, got 2"):
        check_layout(tp2, one_key_head)
    worker = make_worker(folder)
    with pytest.raises(ValueError, match="calibrate_qkv_fp8_scales: not supported yet"):
        worker.calibrate_qkv_fp8_scales(data=make_batch(batch=2, seq=8))


def test_qwen3_next_in_projections_fused_per_key_head_are_read_as_the_parts(tmp_path):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (per key head: q, k, then its value heads' v, z;
    their b, a) become the same [q; k; v; z; b; a] blocks as Qwen3.5's four tensors, and back."""
    folder = make_hf_model(tmp_path / "m", "qwen3_next")
    shape = model_shape(transformers.AutoConfig.from_pretrained(folder))
    assert shape.delta_net == DeltaNetShape(2, 4, 16, 8, 4, grouped_on_disk=True)
    reader = SafetensorsReader(folder)
    m = next(m for m in mappings(shape) if m.mcore.endswith("0.self_attention.in_proj.weight"))
    qkvz, ba = (reader.get(n) for n in m.hf)
    full = m.to_mcore([qkvz, ba], shape)
    head = 16 + 16 + 2 * 8 + 2 * 8  # key head 1's rows: q, k, its 2 value heads' v, then z
    q1, k1, v1, z1 = qkvz[head : 2 * head].split([16, 16, 16, 16])
    q, k, v, z, b, a = full.split(list(shape.delta_net.in_blocks))
    assert torch.equal(q[16:], q1) and torch.equal(k[16:], k1)
    assert torch.equal(v[16:], v1) and torch.equal(z[16:], z1)
    assert torch.equal(b[2:], ba[4:6]) and torch.equal(a[2:], ba[6:8])  # its b, then its a
    assert all(torch.equal(x, y) for x, y in zip(m.to_hf(full, shape), (qkvz, ba), strict=True))


def test_tp_shards_hold_their_heads_and_reshard_pieces_rebuild_them(folder):
    """Under TP2 a rank's fused in-projection holds its key head's q and k rows, the v, z, b,
    a rows of the value heads that read it, and the conv its q, k, v channels; every mapping's
    shards join back exactly, and a reshard's pieces (TP2 -> 1, 1 -> 2) rebuild the other side's
    shards."""
    shape = model_shape(transformers.AutoConfig.from_pretrained(folder))
    reader = SafetensorsReader(folder)
    for m in mappings(shape):  # (vocabulary rows padded for TP: test_weights.py)
        if isinstance(m, VocabRows):
            continue
        full = m.to_mcore([reader.get(n) for n in m.hf], shape)
        assert all(
            torch.equal(a, b)
            for a, b in zip(m.to_hf(full, shape), map(reader.get, m.hf), strict=False)
        )
        shards = {tp: [m.shard(full, r, tp) for r in range(tp)] for tp in (1, 2)}
        assert torch.equal(m.unshard(shards[2]), full), m.mcore
        if m.tp_dim is None:
            continue
        for src, dst in ((2, 1), (1, 2)):
            built = [torch.zeros_like(t) for t in shards[dst]]
            for p in pieces(m, shape, src, dst, shards[src][0].shape[m.tp_dim], src):
                piece = shards[src][p.src_tp].narrow(m.tp_dim, p.src, p.n)
                built[p.dst_tp].narrow(m.tp_dim, p.dst, p.n).copy_(piece)
            assert all(torch.equal(a, b) for a, b in zip(built, shards[dst], strict=False)), (
                m.mcore,
                src,
            )
    layer = "model.layers.0.linear_attn."
    rank1 = next(m for m in mappings(shape) if m.mcore.endswith("0.self_attention.in_proj.weight"))
    got = rank1.shard(rank1.to_mcore([reader.get(n) for n in rank1.hf], shape), 1, 2)
    qkv = reader.get(layer + "in_proj_qkv.weight")
    keys, values = 2 * 16, 4 * 8  # 2 key heads of 16, 4 value heads of 8
    want = [
        qkv[16:32], qkv[keys + 16 : 2 * keys], qkv[2 * keys + 16 :],  # key head 1, value heads 2-3
        reader.get(layer + "in_proj_z.weight")[values // 2 :],
        reader.get(layer + "in_proj_b.weight")[2:], reader.get(layer + "in_proj_a.weight")[2:],
    ]  # fmt: skip
    assert torch.equal(got, torch.cat(want))


def test_logprobs_topk_and_gradients_equal_transformers(each):
    folder = each
    assert_logprobs_and_topk_equal_transformers(folder)
    batch = make_batch(batch=4, seq=12)
    ref = _hf_grads(folder, batch)
    grads = _worker_grads(make_worker(folder), batch)
    assert any(".linear_attn." in n for n in grads)
    _assert_grads_close(grads, {name: _hf_rows(ref, name) for name in grads})


def _assert_grads_close(got: dict, want: dict) -> None:
    """Each parameter's gradient within 1e-5 of its own largest entry, or of 1e-4 x the model's
    largest gradient where its own are smaller: the decays' parameters (A_log, dt_bias,
    in_proj_a) have gradients of 1e-5 to 1e-4 (most decays exp(g) are near 0) beside the
    model's ~5, and fp32 rounding elsewhere reaches them at ~2e-9 (measured)."""
    floor = 1e-4 * max(w.abs().max() for w in want.values())
    for name, g in got.items():
        scale = torch.maximum(want[name].abs().max(), floor)
        assert ((g - want[name]).abs().max() / scale).item() <= 1e-5, name


def test_packing_recompute_and_chunking_equal_plain(folder):
    """Packed sequences (the conv and the recurrence restart at each boundary), recomputed
    layers and chunked scoring give the plain results."""
    data = make_batch(batch=4, seq=14, lengths=[14, 5, 9, 12])
    plain = make_worker(folder)
    want = plain.get_logprobs(data=data)["logprobs"]
    packing = SequencePackingConfig(enabled=True, logprob_mb_tokens=64, train_mb_tokens=64)
    packed = make_worker(folder, sequence_packing=packing)
    reads = HostReads(packed.state.model, GatedDeltaNet)  # a pack's bounds come from the host
    with reads:
        assert (packed.get_logprobs(data=data)["logprobs"] - want).abs().max() <= 1e-5
    assert reads.reads == []
    chunked = make_worker(folder, logprob_chunk_size=5)
    assert (chunked.get_logprobs(data=data)["logprobs"] - want).abs().max() <= 1e-6
    grads = _worker_grads(plain, data)
    full = RecomputeConfig(activation_checkpointing=True)
    for other in (make_worker(folder, recompute=full), packed):
        _assert_grads_close(_worker_grads(other, data), grads)


def test_export_reloads_into_transformers(each, tmp_path):
    from safetensors.torch import load_file

    folder = each
    worker = make_worker(folder)
    out = worker.save_hf_pretrained(tmp_path / "export")
    saved, source = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    assert saved.keys() == source.keys()
    assert all(torch.equal(saved[n], source[n]) for n in source)


def test_generation_keeps_each_layers_state_and_its_logprobs_are_get_logprobs(each):
    """Prompts of different lengths (right-padded: a row's padding neither decays nor writes
    its state, its conv window ends at its own last token); greedy = transformers' `generate`
    (its recurrent cache); sampled rows score as `get_logprobs` scores them."""
    from test_worker_generate import response_mask, scored

    folder = each
    worker = make_worker(folder, generation={"max_new_tokens": 8, "stop_token_ids": []})
    lengths = [14, 3, 9]
    prompts = make_batch(batch=3, seq=14, lengths=lengths)
    out = worker.generate(data=prompts, greedy=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.generation_config.eos_token_id = None
    for row, n in enumerate(lengths):
        with torch.no_grad():
            drawn = model.generate(
                prompts["input_ids"][row : row + 1, :n], max_new_tokens=8, do_sample=False,
                pad_token_id=0,
            )[0]  # fmt: skip
        assert torch.equal(out["output_ids"][row, : n + 8], drawn), row
    sampled = worker.generate(data=prompts, seed=5)
    mask = response_mask(sampled, lengths)
    assert int(mask.sum()) == 24
    # the bound: 4.8e-7 measured (the recurrence token by token against chunked)
    assert (scored(worker, sampled) - sampled["logprobs"])[mask].abs().max() <= 1e-6


def test_a_vision_language_checkpoints_language_model_trains_and_exports(folder, tmp_path):
    """Qwen3.5's published checkpoints are vision-language (`Qwen3_5ForConditionalGeneration`:
    the text model under `model.language_model.`, a vision tower beside it, multimodal RoPE
    sections in its text config): its language model loads (the tower is not read), scores text
    as the vision-language model itself does and as transformers' causal LM of the same folder,
    and exports as that causal LM (`Qwen3_5ForCausalLM`), tensor for tensor the checkpoint's."""
    from safetensors.torch import load_file

    text = transformers.AutoConfig.from_pretrained(folder).to_dict()
    text["rope_parameters"] |= {"mrope_section": [2, 0, 0], "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                  out_hidden_size=64, patch_size=4, spatial_merge_size=2, temporal_patch_size=1)  # fmt: skip
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    vl = tmp_path / "vl"
    transformers.Qwen3_5ForConditionalGeneration(cfg).save_pretrained(vl)
    assert model_shape(transformers.AutoConfig.from_pretrained(vl)).delta_net is not None
    assert_logprobs_and_topk_equal_transformers(vl)  # AutoModelForCausalLM: its text model
    worker = make_worker(vl)
    data = make_batch(batch=3, seq=12)
    whole = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vl).eval()
    with torch.no_grad():
        logits = whole(input_ids=data["input_ids"]).logits[:, :-1].float()
    want = logits.log_softmax(-1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    real = torch.arange(11)[None, :] < data["input_lengths"][:, None] - 1
    got = worker.get_logprobs(data=data)["logprobs"][:, 1:]
    assert ((got - want) * real).abs().max() <= 1e-5
    out = worker.save_hf_pretrained(tmp_path / "export")
    saved, source = load_file(out / "model.safetensors"), load_file(vl / "model.safetensors")
    assert transformers.AutoConfig.from_pretrained(out).architectures == ["Qwen3_5ForCausalLM"]
    assert not any("visual" in n for n in saved)
    for name, t in saved.items():
        on_disk = name.replace("model.", "model.language_model.", 1)
        assert torch.equal(t, source[on_disk if on_disk in source else name]), name


def test_memory_phases_move_the_linear_layers_and_bring_them_back_exactly(tmp_path):
    """Qwen3-Next (Gated DeltaNet layers, experts): offloaded after a step and brought back,
    every parameter is bitwise what it was, and the next step is the step it would have been."""
    from policyworker.losses import NLLLoss

    folder = make_hf_model(tmp_path / "m", "qwen3_next")
    data = make_batch(batch=4, seq=12)
    moved, stayed = make_worker(folder), make_worker(folder)
    for w in (moved, stayed):
        w.train(data, NLLLoss())
    before = {n: p.detach().clone() for n, p in moved.state.model.named_parameters()}
    moved.offload_after_refit()
    assert all(p.device.type == "cpu" for p in moved.state.model.parameters())
    moved.prepare_for_training()
    after = dict(moved.state.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert moved.train(data, NLLLoss())["loss"] == stayed.train(data, NLLLoss())["loss"]
