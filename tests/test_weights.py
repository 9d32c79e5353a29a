"""HF <-> megatron weights: exact round trip, sharded checkpoints, TP shards, save_hf_pretrained."""

import json

import pytest
import torch
from conftest import make_worker
from helpers import hf_logprobs, make_batch, make_hf_model
from safetensors.torch import load_file, save_file

from policyworker.checkpoint import hf as hf_checkpoint
from policyworker.checkpoint.commit import CheckpointSaveError
from policyworker.config import OptimizerConfig
from policyworker.losses import NLLLoss
from policyworker.model.hf_config import model_shape
from policyworker.model.weights import SafetensorsReader, mappings


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_export_of_import_is_bit_exact(tmp_path, arch):
    folder = make_hf_model(tmp_path, arch)
    original = load_file(folder / "model.safetensors")
    worker = make_worker(folder)
    exported = {n: t.cpu() for n, t in worker.export_hf_weights()}
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_sharded_index_checkpoint_loads(tmp_path):
    folder = make_hf_model(tmp_path / "single", "qwen2")
    tensors = load_file(folder / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / fname)
        weight_map |= dict.fromkeys(part, fname)
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    data = make_batch(batch=3, seq=10)
    a = make_worker(folder).get_logprobs(data=data)["logprobs"]
    b = make_worker(sharded).get_logprobs(data=data)["logprobs"]
    assert torch.equal(a, b)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_join_back_exactly(tmp_path, tp):
    # vocab divisible by tp (a padded vocabulary: test_vocabulary_padded_for_tp_round_trips)
    folder = make_hf_model(
        tmp_path, "qwen2", num_attention_heads=8, num_key_value_heads=4, vocab_size=128
    )
    from transformers import AutoConfig

    shape = model_shape(AutoConfig.from_pretrained(folder))
    reader = SafetensorsReader(folder)
    for m in mappings(shape):
        full = m.to_mcore([reader.get(n) for n in m.hf], shape)
        shards = [m.shard(full, r, tp) for r in range(tp)]
        assert torch.equal(m.unshard(shards), full), m.mcore
        if m.tp_dim is not None:
            assert all(s.shape[m.tp_dim] * tp == full.shape[m.tp_dim] for s in shards)
    # a TP rank's fused QKV holds whole query groups: [q of its heads, k, v] per group
    qkv = next(m for m in mappings(shape) if m.mcore.endswith("0.self_attention.linear_qkv.weight"))
    full = qkv.to_mcore([reader.get(n) for n in qkv.hf], shape)
    q = reader.get("model.layers.0.self_attn.q_proj.weight")
    hd = shape.head_dim
    rank1 = qkv.shard(full, 1, tp)
    groups_per_rank = shape.num_kv_heads // tp
    first_group = groups_per_rank  # rank 1 starts at this query group
    q_rows = q[
        first_group * shape.heads_per_group * hd : (first_group + 1) * shape.heads_per_group * hd
    ]
    assert torch.equal(rank1[: shape.heads_per_group * hd], q_rows)


def test_save_hf_pretrained_round_trip(tmp_path, llama_dir):
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-2))
    data = make_batch(batch=4, seq=12)
    for _ in range(2):
        worker.train(data, NLLLoss())
    out = worker.save_hf_pretrained(tmp_path / "export")
    ours = worker.get_logprobs(data=data)["logprobs"]
    theirs = hf_logprobs(out, data)
    assert (ours - theirs).abs().max() <= 1e-4
    assert (
        theirs - hf_logprobs(llama_dir, data)
    ).abs().max() > 1e-2  # trained weights, not initial
    # saving again over the same folder replaces it atomically
    worker.save_hf_pretrained(tmp_path / "export")
    assert not list(tmp_path.glob(".export.*")) and not (tmp_path / "export.old").exists()


def test_save_splits_into_indexed_shards(tmp_path, llama_dir, monkeypatch):
    monkeypatch.setattr(hf_checkpoint, "SHARD_BYTES", 64 * 1024)
    worker = make_worker(llama_dir)
    out = worker.save_hf_pretrained(tmp_path / "export")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    data = make_batch(batch=2, seq=10)
    assert (hf_logprobs(out, data) - hf_logprobs(llama_dir, data)).abs().max() == 0


def test_crash_during_save_keeps_the_old_folder(tmp_path, llama_dir):
    worker = make_worker(llama_dir)
    out = worker.save_hf_pretrained(tmp_path / "export")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crashing():
        yield from list(worker.export_hf_weights())[:3]
        raise OSError("disk full")

    with pytest.raises(CheckpointSaveError, match=r"saving .*export failed: .*disk full"):
        hf_checkpoint.save_hf_folder(out, hf_config=worker.hf_config, tensors=crashing())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary left


def test_vocabulary_padded_for_tp_round_trips(tmp_path):
    """101 rows over TP3: megatron holds 102 (a zero row), each rank 34; HF export has 101."""
    folder = make_hf_model(tmp_path, "llama", vocab_size=101)
    from transformers import AutoConfig

    shape = model_shape(AutoConfig.from_pretrained(folder))
    reader = SafetensorsReader(folder)
    assert shape.padded_vocab_size(3) == 102 and shape.padded_vocab_size(1) == 101
    for m in mappings(shape, tp=3):
        hf = [reader.get(n) for n in m.hf]
        full = m.to_mcore(hf, shape)
        if "embed" in m.hf[0] or "lm_head" in m.hf[0]:
            assert full.shape[0] == 102 and (full[101:] == 0).all()
            assert all(s.shape[0] == 34 for s in (m.shard(full, r, 3) for r in range(3)))
        back = m.to_hf(m.unshard([m.shard(full, r, 3) for r in range(3)]), shape)
        assert all(torch.equal(a, b) for a, b in zip(back, hf, strict=True)), m.mcore
