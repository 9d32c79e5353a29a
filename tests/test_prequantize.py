"""MXFP8 refit prequantization (#29, the seed's `enable_refit_prequantize`): the format, the
refit info it derives, and the weights it carries over IPC (direct and buffered) and the
collective transport."""

from __future__ import annotations

import pytest
import torch
from conftest import make_worker
from helpers import make_batch

from policyworker.config import OptimizerConfig, RefitConfig
from policyworker.generation.engine import HFEngine
from policyworker.generation.process import GenerationProcess
from policyworker.losses import NLLLoss
from policyworker.ops.mxfp8 import (
    E4M3_MAX,
    SCALE_SUFFIX,
    dequantize_mxfp8,
    mxfp8_error_bound,
    quantize_mxfp8,
)
from policyworker.parallel.dims import free_port
from policyworker.refit.layout import RefitError
from policyworker.refit.prequantize import check_prequantize

SMALL_BUFFER = 8192
NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.down_proj.weight",  # [64, 96]: three blocks per row
    "model.layers.1.mlp.gate_proj.weight",
    "lm_head.weight",
]


def test_format_round_trip_is_within_its_bound():
    """Values are E4M3 within ±448, each block's exponent the smallest that fits its amax, an
    all-zero block gets byte 1, and every element dequantizes within the format's bound."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 128, generator=g) * torch.logspace(-30, 20, 128, base=2.0)
    x = x.to(torch.bfloat16)
    x[2, 32:64] = 0
    values, scales = quantize_mxfp8(x)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (16, 4)
    assert values.float().abs().max() <= E4M3_MAX
    assert int(scales[2, 1]) == 1 and (dequantize_mxfp8(values, scales)[2, 32:64] == 0).all()
    amax = x.float().reshape(16, 4, 32).abs().amax(-1)
    exponent = scales.float() - 127
    nonzero = amax > 0
    assert (amax / torch.exp2(exponent) <= E4M3_MAX)[nonzero].all()  # fits
    assert (amax / torch.exp2(exponent - 1) > E4M3_MAX)[nonzero].all()  # the smallest that does
    err = (dequantize_mxfp8(values, scales) - x.float()).abs()
    assert (err <= mxfp8_error_bound(x, scales)).all()


def test_prequantized_refit_info_is_derived_without_tensors(llama_dir):
    """The listed weights become float8_e4m3fn with a uint8 `*_scale_from_checkpoint` right
    after them ([rows, cols / 32]); the rest is unchanged; an empty list turns it off."""
    worker = make_worker(llama_dir)
    base = worker.prepare_refit_info()
    info = worker.enable_refit_prequantize(list(NAMES))
    assert worker.prepare_refit_info() == info
    names = list(info)
    for name in NAMES:
        shape, _ = base[name]
        assert info[name] == (shape, torch.float8_e4m3fn)
        assert names[names.index(name) + 1] == name + SCALE_SUFFIX
        assert info[name + SCALE_SUFFIX] == ((shape[0], shape[1] // 32), torch.uint8)
    assert {n: v for n, v in info.items() if n not in NAMES and SCALE_SUFFIX not in n} == {
        n: v for n, v in base.items() if n not in NAMES
    }
    assert worker.enable_refit_prequantize([]) == base


def test_bad_names_are_refused_and_change_nothing(llama_dir):
    worker = make_worker(llama_dir)
    base = worker.prepare_refit_info()
    for bad, match in [
        (["model.layers.0.nope.weight"], "not in the refit info"),
        ([NAMES[0], NAMES[0]], "twice"),
        ("model.layers.0.self_attn.q_proj.weight", "a list"),
    ]:
        with pytest.raises(ValueError, match=match):
            worker.enable_refit_prequantize(bad)
    assert worker.prepare_refit_info() == base
    odd = {"w": ((8, 48), torch.bfloat16), "i": ((64,), torch.int64)}
    with pytest.raises(ValueError, match="not a multiple of 32"):
        check_prequantize(["w"], odd)
    with pytest.raises(ValueError, match="floating-point"):
        check_prequantize(["i"], odd)
    worker.enable_refit_prequantize(NAMES[:1])
    with pytest.raises(ValueError, match="prequantization"):  # reshard moves megatron weights
        worker.init_reshard("127.0.0.1", free_port(), 1, 1)


def _check_received(got: dict, sent: dict, names: list[str]) -> None:
    """The engine holds, for each prequantized name, exactly the trainer's quantization of the
    exported weight (its dequantization within the bound), and every other weight bitwise."""
    for name, tensor in sent.items():
        if name not in names:
            assert torch.equal(got[name], tensor), name
            continue
        values, scales = quantize_mxfp8(tensor)
        assert got[name].dtype == torch.float8_e4m3fn
        assert torch.equal(got[name].view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(got[name + SCALE_SUFFIX], scales), name
        err = (dequantize_mxfp8(got[name], got[name + SCALE_SUFFIX]) - tensor).abs()
        assert (err <= mxfp8_error_bound(tensor, scales)).all(), name


def _local_engine(folder, sent, names) -> HFEngine:
    """An engine given each weight by hand (the prequantized ones dequantized here): what the
    refitted engine must score."""
    local = HFEngine(str(folder), None, device=torch.device("cpu"))
    targets = local.refit_targets({n: (tuple(t.shape), t.dtype) for n, t in sent.items()})
    with torch.no_grad():
        for name, tensor in sent.items():
            value = dequantize_mxfp8(*quantize_mxfp8(tensor)) if name in names else tensor
            targets[name].copy_(value)
    return local


@pytest.mark.processes
@pytest.mark.parametrize("transport", ["ipc-direct", "ipc-buffers", "collective"])
def test_every_transport_carries_the_mxfp8_slots(llama_dir, transport):
    """Refits after training steps (two into the shared staging, one on the other paths): the
    engine receives the fp8 values and scales bit for bit, and scores with their
    dequantization exactly as an engine given them by hand."""
    refit = RefitConfig(checksum=True, timeout_s=30.0)
    worker = make_worker(llama_dir, optimizer=OptimizerConfig(lr=1e-2), refit=refit)
    info = worker.enable_refit_prequantize(list(NAMES))
    data = make_batch(batch=4, seq=12)
    if transport == "collective":
        port = free_port()
        gen = GenerationProcess(str(llama_dir), info, timeout_s=30.0)
        gen.init_collective("127.0.0.1", port, 2, 1)
        worker.init_collective("127.0.0.1", port, 2)
    else:
        gen = GenerationProcess(str(llama_dir), info, shared_staging=transport == "ipc-direct")
    with gen:
        for version in (1, 2) if transport == "ipc-direct" else (1,):
            worker.train(data, NLLLoss())
            if transport == "collective":
                gen.begin_refit_collective()
                report = worker.broadcast_weights_for_collective(buffer_size_bytes=SMALL_BUFFER)
            else:
                gen.begin_refit_ipc(worker.get_zmq_address())
                report = worker.stream_weights_via_ipc_zmq(buffer_size_bytes=SMALL_BUFFER)
            assert gen.end_refit() == report.version == version
            assert report.names == len(info)
            sent = dict(worker.export_hf_weights())
            _check_received(gen.weights(), sent, NAMES)
            local = _local_engine(llama_dir, sent, NAMES)
            ids, lengths = data["input_ids"], data["input_lengths"]
            assert torch.equal(gen.logprobs(ids, lengths), local.logprobs(ids, lengths))


@pytest.mark.processes
def test_an_engine_expecting_bf16_refuses_the_fp8_slots(llama_dir):
    """The receiver's staging checks the new slots: an engine prepared for the plain refit
    info refuses a prequantized refit by name on both sides, and keeps its weights."""
    worker = make_worker(llama_dir)
    plain = worker.prepare_refit_info()
    worker.enable_refit_prequantize(list(NAMES))
    with GenerationProcess(str(llama_dir), plain) as gen:
        before = gen.weights()
        gen.begin_refit_ipc(worker.get_zmq_address())
        with pytest.raises(RefitError, match=r"q_proj\.weight sent as"):
            worker.stream_weights_via_ipc_zmq(buffer_size_bytes=SMALL_BUFFER)
        with pytest.raises(RefitError, match=r"q_proj\.weight sent as"):
            gen.end_refit()
        after = gen.weights()
        assert all(torch.equal(before[n], after[n]) for n in before)
    assert worker.weight_version == 0
