"""The new families' weights through the refit transports into the transformers engine: GLM-4.5
(sigmoid routers whose expert bias is a buffer, not a parameter; ungated shared experts) through
every transport, DeepSeek-V3 (latent attention's projections and norms) and gpt-oss (sinks,
biases, experts sent fused as its checkpoints hold them), Qwen3.5 and Qwen3-Next (Gated DeltaNet
layers) too, after a step that moved the
weights (and the expert bias) — the engine holds the trainer's export bit for bit and scores as
the trainer does."""

from __future__ import annotations

import pytest
import torch
from conftest import make_worker
from helpers import make_batch, make_hf_model

from policyworker.config import MoEConfig, OptimizerConfig
from policyworker.generation.process import GenerationProcess
from policyworker.losses import NLLLoss
from policyworker.parallel.dims import free_port
from policyworker.refit.sparse import KEY_ENV

pytestmark = pytest.mark.processes

KEY = "a test run's key"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {
        f: make_hf_model(tmp_path_factory.mktemp(f), f)
        for f in ("glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_5", "qwen3_next")
    }


def _refit(worker, gen: GenerationProcess, transport: str) -> None:
    if transport == "ipc":
        gen.begin_refit_ipc(worker.get_zmq_address())
        worker.stream_weights_via_ipc_zmq()
    elif transport == "collective":
        gen.begin_refit_collective()
        worker.broadcast_weights_for_collective()
    else:
        target = gen.bind_sparse(api_key=KEY)
        gen.begin_refit_sparse("t1", 1)
        worker.stream_remote_sparse_weights(
            "zmq", [target], transfer_id="t1", api_key_env_var=KEY_ENV, timeout_s=30.0,
            shard_rank=0, shard_count=1, overwrite_names=[],
        )  # fmt: skip
    assert gen.end_refit() == 1
    if transport == "sparse":
        worker.finish_remote_sparse_delta_sync(succeeded=True)


@pytest.mark.parametrize(
    ("family", "transport"),
    [
        ("glm4_moe", "ipc"),
        ("glm4_moe", "collective"),
        ("glm4_moe", "sparse"),
        ("deepseek_v3", "ipc"),
        ("deepseek_v3", "collective"),
        ("deepseek_v3", "sparse"),
        ("gpt_oss", "ipc"),  # the collective transport sends the same names and tensors
        ("gpt_oss", "sparse"),
        # Gated DeltaNet layers: Qwen3.5's in-projections as four tensors, Qwen3-Next's fused
        # per key head
        ("qwen3_5", "sparse"),
        ("qwen3_next", "ipc"),
    ],
)
def test_refits_into_the_transformers_engine_exactly(folders, family, transport, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    folder = folders[family]
    moe = MoEConfig(moe_router_bias_update_rate=1e-2)
    worker = make_worker(folder, optimizer=OptimizerConfig(lr=1e-2), moe=moe)
    info = worker.prepare_refit_info()
    moved = {  # the sigmoid routers' expert bias; a weight only these families have
        "gpt_oss": "model.layers.1.mlp.experts.gate_up_proj_bias",
        "qwen3_5": "model.layers.0.linear_attn.in_proj_qkv.weight",
        "qwen3_next": "model.layers.0.linear_attn.in_proj_qkvz.weight",
    }.get(family, "model.layers.1.mlp.gate.e_score_correction_bias")
    assert moved in info
    if transport == "sparse":
        worker.init_remote_sparse_delta_baseline(shard_rank=0, shard_count=1, transport="zmq")
    data = make_batch(batch=4, seq=12)
    before = {n: t.clone() for n, t in worker.export_hf_weights()}  # views of the live weights
    worker.train(data, NLLLoss())
    sent = dict(worker.export_hf_weights())
    assert not torch.equal(sent[moved], before[moved])  # the step moved it
    with GenerationProcess(str(folder), info, timeout_s=60.0) as gen:
        if transport == "collective":
            port = free_port()
            gen.init_collective("127.0.0.1", port, 2, 1)
            worker.init_collective("127.0.0.1", port, 2)
        _refit(worker, gen, transport)
        got = gen.weights()
        assert got.keys() == sent.keys()
        assert all(torch.equal(got[n], sent[n]) for n in sent)  # bitwise
        ids, lengths = data["input_ids"], data["input_lengths"]
        ours = worker.get_logprobs(data=data)["logprobs"]
        assert (gen.logprobs(ids, lengths) - ours).abs().max().item() <= 1e-5
