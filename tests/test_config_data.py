"""Config (YAML + dotted overrides) and BatchedDataDict semantics."""

import pytest
import torch

from policyworker.config import PolicyConfig, load_config, to_dict
from policyworker.data.batched_data_dict import BatchedDataDict


def test_defaults_need_only_model_name():
    cfg = PolicyConfig(model_name="/ckpt")
    assert cfg.parallel.tensor_model_parallel_size == 1 and cfg.optimizer.betas == (0.9, 0.999)


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "model_name: /ckpt\nprecision: float32\noptimizer:\n  lr: 1.0e-5\n  betas: [0.9, 0.95]\nscheduler:\n  style: cosine\n  warmup_steps: 10\n"
    )
    cfg = load_config(
        path,
        [
            "optimizer.lr=3e-4",
            "parallel.tensor_model_parallel_size=2",
            "sequence_packing.enabled=true",
        ],
    )
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.scheduler.style == "cosine" and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.sequence_packing.enabled is True
    again = load_config(None, [f"{k}={v}" for k, v in _flatten(to_dict(cfg)).items()])
    assert again == cfg


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["precision=fp8"], "precision"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["optimizer.lr=fast"], "optimizer.lr"),
        (["optimizer.betas=[0.9, 1.5]"], "optimizer.betas"),
        (["scheduler.style=step"], "scheduler.style"),
        (["scheduler.warmup_steps=5", "scheduler.decay_steps=5"], "scheduler.decay_steps"),
        (["parallel.tensor_model_parallel_size=0"], "parallel.tensor_model_parallel_size"),
        (
            ["sequence_packing.make_sequence_length_divisible_by=0"],
            "make_sequence_length_divisible_by",
        ),
        (["nope=1"], "nope"),
        (["optimizer.nope=1"], "optimizer.nope"),
        (["optimizer=3"], "optimizer"),
        (["no_equals_sign"], "key.path=value"),
    ],
)
def test_bad_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("[", r"\[")):
        load_config(None, ["model_name=/ckpt", *overrides])


def _bdd(n=6):
    return BatchedDataDict(
        x=torch.arange(n * 2).reshape(n, 2), y=torch.arange(n), tag=[f"s{i}" for i in range(n)]
    )


def test_slice_select_shard_iterate():
    d = _bdd()
    assert d.size == 6
    assert d.slice(1, 3)["tag"] == ["s1", "s2"]
    sel = d.select_indices([4, 0])
    assert sel["y"].tolist() == [4, 0] and sel["tag"] == ["s4", "s0"]
    shards = d.shard_by_batch_size(2)
    assert [s["y"].tolist() for s in shards] == [[0, 1, 2], [3, 4, 5]]
    # per global batch of 4: each DP shard takes its part of every global batch
    d8 = _bdd(8)
    shards = d8.shard_by_batch_size(2, batch_size=4)
    assert [s["y"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [mb["y"].tolist() for mb in d.make_microbatch_iterator(4)] == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError):
        d.shard_by_batch_size(4)


def test_from_batches_pads_and_merges():
    a = BatchedDataDict(
        ids=torch.ones(2, 3, dtype=torch.long), n=torch.tensor([3, 3]), tag=["a", "b"]
    )
    b = BatchedDataDict(ids=torch.ones(1, 5, dtype=torch.long), n=torch.tensor([5]), tag=["c"])
    m = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": 7})
    assert m["ids"].shape == (3, 5) and m["ids"][0].tolist() == [1, 1, 1, 7, 7]
    assert m["n"].tolist() == [3, 3, 5] and m["tag"] == ["a", "b", "c"]
    assert m.to("cpu")["ids"].device.type == "cpu"


def test_inconsistent_sizes_are_reported():
    with pytest.raises(ValueError, match="batch size"):
        _ = BatchedDataDict(x=torch.zeros(2), y=torch.zeros(3)).size
