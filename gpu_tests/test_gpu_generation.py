"""GPU checks of generation in the worker (run on the device, not in CI): bf16 generation
logprobs against `get_logprobs` of the output (the reference gates on token_mult_prob_error
< 1.05; our target is a mean <= 1.01), fp32 ones equal, greedy = transformers' greedy, and no
KV-cache memory left behind.

python -m pytest -q gpu_tests/test_gpu_generation.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import make_hf_model
from test_gpu_parity import MEDIUM

from policyworker.config import PolicyConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.worker import MegatronPolicyWorker

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

NEW = 48


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("gpu_gen"), "llama", **MEDIUM)


def _worker(folder, precision, graphs=True, kernel="sdpa", invariant=False, packed=False):
    cfg = PolicyConfig(
        model_name=str(folder),
        precision=precision,
        batch_invariant=invariant,
        sequence_packing={"enabled": packed},
        logprob_batch_size=8,
        max_total_sequence_length=128,
        generation={
            "max_new_tokens": NEW,
            "stop_token_ids": [],
            "cuda_graphs": graphs,
            "decode_attention": kernel,
        },
    )
    return MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)


def _prompts(vocab: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([40, 7, 23, 1, 64, 12, 33, 50])
    ids = torch.randint(0, vocab, (8, 64), generator=g)
    ids[torch.arange(64)[None, :] >= lengths[:, None]] = 0
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths})


def _errors(worker, data, out) -> torch.Tensor:
    """exp|generation - get_logprobs| at every response token."""
    seqs = {"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]}
    scored = worker.get_logprobs(data=BatchedDataDict(seqs))["logprobs"]
    pos = torch.arange(scored.shape[1])[None, :]
    mask = (pos >= data["input_lengths"][:, None]) & (
        pos < out["unpadded_sequence_lengths"][:, None]
    )
    return (scored - out["logprobs"]).abs().exp()[mask]


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_generation_logprobs_match_get_logprobs(folder, precision, kernel):
    worker = _worker(folder, precision, kernel=kernel)
    data = _prompts(worker.shape.vocab_size)
    worker.generate(data=data, seed=1)  # the first call's one-time buffers (compiled kernels)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = worker.generate(data=data, seed=0)
    assert torch.cuda.memory_allocated() == before  # the KV cache and graph went with the call
    errors = _errors(worker, data, out)
    print(
        f"{precision} {kernel}: token_mult_prob_error mean {errors.mean():.6f} max {errors.max():.6f}"
    )
    if precision == "bfloat16":
        assert errors.mean() <= 1.01
    else:
        assert (errors.log()).max() <= 1e-4


@pytest.mark.parametrize("graphs,packed", [(True, False), (False, True)])
@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_batch_invariant_generation_logprobs_are_get_logprobs_bitwise(
    folder, precision, graphs, packed
):
    worker = _worker(folder, precision, graphs=graphs, invariant=True, packed=packed)
    data = _prompts(worker.shape.vocab_size)
    out = worker.generate(data=data, seed=0)
    errors = _errors(worker, data, out)
    print(f"{precision} invariant: {(errors != 1).sum()} of {errors.numel()} differ")
    assert errors.numel() > 100
    if precision == "bfloat16":  # measured bitwise on an H200 and an H100 80GB HBM3
        assert (errors == 1).all()
    else:  # fp32: about half the tokens differ in their last bits (H200; cause not located)
        assert errors.log().max() <= 1e-5


def test_race_draws_from_the_softmax_and_splits_alike():
    from policyworker.ops.draw import race

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2000, device="cuda", generator=g) * 2
    rows = 100_000
    ids = torch.arange(rows, device="cuda")
    tokens = race(x.expand(rows, -1).contiguous(), 0.8, torch.Generator("cuda").manual_seed(1), ids)
    p = torch.softmax(x.double() / 0.8, 0)
    seen = torch.bincount(tokens, minlength=2000).double() / rows
    z = ((seen - p).abs() / (p * (1 - p) / rows).sqrt())[p > 1e-3]
    assert z.max() < 5, float(z.max())
    # one row's draw does not depend on how many rows (and so programs) the call had, nor on
    # its place in the call: on its id
    wide = torch.randn(300, 128_256, device="cuda", dtype=torch.bfloat16, generator=g)
    a = race(wide, 1.0, torch.Generator("cuda").manual_seed(2), ids[:300])
    b = race(wide[:7], 1.0, torch.Generator("cuda").manual_seed(2), ids[:7])
    c = race(wide[5:9], 1.0, torch.Generator("cuda").manual_seed(2), ids[5:9])
    assert torch.equal(a[:7], b) and torch.equal(a[5:9], c)


def test_greedy_equals_transformers_in_fp32(folder):
    from transformers import AutoModelForCausalLM

    worker = _worker(folder, "float32")
    data = _prompts(worker.shape.vocab_size)
    out = worker.generate(data=data, greedy=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    same = 0
    for row, n in enumerate(data["input_lengths"].tolist()):
        want = hf.generate(
            data["input_ids"][row : row + 1, :n].cuda(), max_new_tokens=NEW, do_sample=False,
            pad_token_id=0,
        )[0].cpu()  # fmt: skip
        same += out["output_ids"][row, : n + NEW].tolist() == want.tolist()
    assert same >= 7  # TF32-free fp32 on both sides; one near-tie may break differently


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_graphed_decode_equals_step_by_step_in_fp32(folder, kernel):
    graphed = _worker(folder, "float32", kernel=kernel)
    eager = _worker(folder, "float32", graphs=False, kernel=kernel)
    assert graphed.sampler.decoder.graphs and not eager.sampler.decoder.graphs
    data = _prompts(graphed.shape.vocab_size)
    a, b = graphed.generate(data=data, seed=3), eager.generate(data=data, seed=3)
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert (a["logprobs"] - b["logprobs"]).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_equals_sdpa(dtype):
    """`ops.decode_attention` on the GPU against SDPA's masked grouped attention in fp32: rows of
    different lengths, slots past them holding NaN (never read), several splits of a row, and a
    graph capture of one call replayed after the lengths changed."""
    from policyworker.ops.decode_attention import decode_attention, splits_for

    g = torch.Generator(device="cuda").manual_seed(0)
    for b, heads, groups, dim, capacity in ((4, 32, 8, 64, 1536), (1, 16, 2, 128, 4096)):
        q = torch.randn(b, heads, dim, generator=g, device="cuda", dtype=dtype)
        k, v = (
            torch.randn(b, groups, capacity, dim, generator=g, device="cuda", dtype=dtype)
            for _ in range(2)
        )
        pos = torch.randint(0, capacity, (b,), generator=g, device="cuda")
        pos[0] = capacity - 1

        bound = 2e-6 if dtype == torch.float32 else 2e-2
        for row in range(b):  # what lies past a row's length must not be read
            k[row, :, pos[row] + 1 :] = float("nan")
            v[row, :, pos[row] + 1 :] = float("nan")
        assert (
            decode_attention(q, k, v, pos, dim**-0.5).float() - _sdpa_decode(q, k, v, pos)
        ).abs().max() <= bound
        graph = torch.cuda.CUDAGraph()
        decode_attention(q, k, v, pos, dim**-0.5)  # compile outside the capture
        with torch.cuda.graph(graph):
            out = decode_attention(q, k, v, pos, dim**-0.5)
        pos.copy_(torch.randint(0, capacity, (b,), generator=g, device="cuda"))
        k.nan_to_num_(0.0), v.nan_to_num_(0.0)
        graph.replay()
        assert (out.float() - _sdpa_decode(q, k, v, pos)).abs().max() <= bound
        print(
            dtype,
            b,
            heads,
            groups,
            dim,
            capacity,
            "splits",
            splits_for(b, groups, capacity, q.device),
        )


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
    """SDPA's masked grouped decode attention in fp32, the slots past each row's position zeroed."""
    from policyworker.model.attention.cached import masked_grouped

    reach = torch.arange(k.shape[2], device="cuda")[None, :] <= pos[:, None]
    kk = torch.where(reach[:, None, :, None], k.float(), 0.0)
    vv = torch.where(reach[:, None, :, None], v.float(), 0.0)
    ref = masked_grouped(q[:, :, None].float(), kk, vv, pos[None, :], q.shape[-1] ** -0.5)
    return ref[:, :, 0]


def test_decode_kernel_large_cache():
    """A cache of more than 2**31 elements (72 rows x 8 key heads x 32768 x 128): the last
    rows' offsets pass int32; they equal SDPA on those rows alone."""
    from policyworker.ops.decode_attention import decode_attention

    b, heads, groups, dim, capacity = 72, 32, 8, 128, 32768
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(b, groups, capacity, dim, generator=g, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    assert k.numel() > 2**31
    pos = torch.full((b,), capacity - 1, device="cuda")
    out = decode_attention(q, k, v, pos, dim**-0.5)
    last = slice(b - 2, b)
    want = _sdpa_decode(q[last], k[last], v[last], pos[last])
    assert (out[last].float() - want).abs().max() <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_equal_decode_steps_bitwise(dtype):
    """`attention_rows` on the GPU: each row equals a one-split decode step at its position over
    the same keys bit for bit (the tiles' MMAs give a row the same bits whatever rows share its
    tile), and it equals causal SDPA to rounding."""
    import torch.nn.functional as F

    from policyworker.ops.decode_attention import attention_rows, decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, heads, groups, dim, seq = 3, 32, 8, 64, 700
    q, k, v = (
        torch.randn(b, h, seq, dim, generator=g, device="cuda", dtype=dtype)
        for h in (heads, groups, groups)
    )
    rows = attention_rows(q, k, v, dim**-0.5)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, scale=dim**-0.5, enable_gqa=True
    )
    assert (rows.float() - ref).abs().max() <= (2e-6 if dtype == torch.float32 else 2e-2)
    differing = 0
    for t in range(seq):
        at = torch.full((b,), t, device="cuda")
        step = decode_attention(q[:, :, t].contiguous(), k, v, at, dim**-0.5, one_split=True)
        differing += int((step != rows[:, :, t]).sum())
    assert differing == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_into_cache_is_rope_and_indexed_writes_bitwise(dtype):
    """A KV cache's write in one kernel (`ops.rope.rope_into_cache`) compiled for the GPU: the
    queries (rotated in place) and cached keys have the bits of `rope`'s kernel (what scoring
    rotates with), the values are copied, and no other slot changes — a decode step and the
    prefill alike."""
    from policyworker.model.attention.rotary import Rotary
    from policyworker.ops.rope import rope, rope_into_cache

    rotary = Rotary()
    rotary.inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    g = torch.Generator(device="cuda").manual_seed(0)
    b, groups, rep, d, capacity = 5, 8, 4, 64, 1100
    for s, starts in ((1, [1000, 3, 77, 512, 0]), (300, [0] * b)):
        qkv = torch.randn(s, b, groups, (rep + 2) * d, generator=g, device="cuda", dtype=dtype)
        query = qkv[..., : rep * d].reshape(s, b, groups * rep, d)
        key, value = qkv[..., rep * d : (rep + 1) * d], qkv[..., (rep + 1) * d :]
        positions = (
            torch.tensor(starts, device="cuda")[None, :] + torch.arange(s, device="cuda")[:, None]
        )
        cos, sin = rotary.angles(positions[..., None], dtype)
        keys, values = (
            torch.randn(b, groups, capacity, d, generator=g, device="cuda", dtype=dtype)
            for _ in range(2)
        )
        want_k, want_v, want_q = keys.clone(), values.clone(), rope(query, cos, sin)
        rope_into_cache(query, key, value, (cos, sin), positions, (keys, values))
        rows = torch.arange(b, device="cuda")[None, :].expand(s, b)
        want_k[rows, :, positions] = rope(key, cos, sin)
        want_v[rows, :, positions] = value
        assert torch.equal(query, want_q)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)


@pytest.mark.parametrize("m", [1, 8])
def test_decode_gemms_reproduce_scoring_bits(m):
    """What batch invariance rests on for the matmuls: each projection of the test model (bf16)
    on `m` real rows padded to 256 — eager, and captured in a CUDA graph as a decode step is —
    gives the bits of the same rows inside a 256- to 6144-row product (scoring's). cuBLAS does
    not promise it; on a card where this fails, the bitwise test above fails too, and this
    names the projection and the size (measured: no differing bit on an H100 and an H200)."""
    import torch.nn.functional as F

    h, inter, vocab, kv = MEDIUM["hidden_size"], MEDIUM["intermediate_size"], 1024, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"qkv": (h, h + 2 * kv), "o": (h, h), "gate_up": (h, 2 * inter),
              "down": (inter, h), "lm_head": (h, vocab)}  # fmt: skip
    differ = {}
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16() * 0.02
        x = torch.randn(6144, k, device="cuda", generator=g).bfloat16()
        padded = F.pad(x[:m], (0, 0, 0, 256 - m))
        eager = F.linear(padded, w)[:m]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            F.linear(padded, w)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph, out = torch.cuda.CUDAGraph(), {}
        with torch.cuda.graph(graph):
            out["y"] = F.linear(padded, w)
        graph.replay()
        for rows in (256, 300, 512, 896, 1024, 2048, 6144):
            whole = F.linear(x[:rows], w)[:m]
            for how, y in (("eager", eager), ("graph", out["y"][:m])):
                bad = int((y != whole).sum())
                if bad:
                    differ[f"{name} {how} in {rows} rows"] = bad
    assert not differ, differ
