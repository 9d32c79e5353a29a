"""Our Triton kernels compiled for an H100/H200 (sm_90) on the CPU, through Triton's
ahead-of-time path down to a cubin (its bundled ptxas): what Triton's interpreter, which runs
them in numpy in the other tests, does not check — the compiler's type and shape rules. The
decode path's kernels, the draw, RMSNorm and the MoE token gather (the AdamW kernel reads
pointer tables: its own GPU test)."""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from policyworker.ops import decode_attention, draw, rms_norm, rope, token_gather

SM90 = GPUTarget("cuda", 90, 32)


@pytest.fixture(autouse=True)
def _compile_cache(tmp_path, monkeypatch):
    """Triton's compile cache in the test's folder: really compiled each run, nothing left in
    the home directory."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


def compile_for_sm90(fn: object, dtype: str, consts: dict, warps: int = 4, **kinds: str) -> bytes:
    """`fn`'s cubin for sm_90: pointers (`*_ptr`) to `dtype` unless `kinds` names them, `scale`
    fp32, other arguments int32, `consts` its constexprs."""
    names = fn.arg_names  # type: ignore[attr-defined]
    signature = {
        n: "constexpr"
        if n in consts
        else kinds.get(n, f"*{dtype}" if n.endswith("_ptr") else "fp32" if n == "scale" else "i32")
        for n in names
    }
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=SM90, options={"num_warps": warps}).asm["cubin"]


TILES = dict(DIM=64, BLOCK_M=16, BLOCK_D=64)


@pytest.mark.processes  # ptxas
@pytest.mark.parametrize(
    "dtype,splits", [("bf16", 1), ("bf16", 4), ("fp32", 1)], ids=["bf16", "bf16-splits", "fp32"]
)
def test_decode_kernels_compile_for_sm90(dtype, splits):
    precision = "tf32" if dtype == "bf16" else "ieee"
    block_n = 128 if dtype == "bf16" else 64
    partial = {"o_ptr": f"*{dtype}" if splits == 1 else "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
    consts = dict(GROUPS=8, REP=4, SPLITS=splits, BLOCK_N=block_n, PRECISION=precision, **TILES)
    assert compile_for_sm90(
        decode_attention._partial_kernel, dtype, consts, pos_ptr="*i64", **partial
    )
    if splits > 1:
        consts = dict(SPLITS=splits, BLOCK_S=splits, DIM=64, BLOCK_D=64)
        sums = {"part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}
        assert compile_for_sm90(decode_attention._combine_kernel, dtype, consts, **sums)
    consts = dict(HEADS=32, REP=4, BLOCK_N=block_n, PRECISION=precision, **TILES)
    assert compile_for_sm90(decode_attention._prefill_kernel, dtype, consts)
    consts = dict(HEADS=32, GROUPS=8, HALF=32, BLOCK_H=32, BLOCK_G=8, BLOCK=32)
    assert compile_for_sm90(rope._into_cache_kernel, dtype, consts, pos_ptr="*i64")
    for inverse in (False, True):
        consts = dict(HALF=32, ROWS=64, BLOCK=32, INVERSE=inverse)
        assert compile_for_sm90(rope._rope_kernel, dtype, consts)


@pytest.mark.processes  # ptxas
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_draw_norm_and_gather_kernels_compile_for_sm90(dtype):
    ints = {
        "seed_ptr": "*i64",
        "rows_ptr": "*i64",
        "key_ptr": "*fp32",
        "idx_ptr": "*i32",
        "inv_t": "fp32",
    }
    assert compile_for_sm90(draw._race_kernel, dtype, dict(BLOCK=draw.BLOCK), **ints)
    for hidden in (2048, 8192):  # 4 and 8 warps (`_tile`)
        rows, block, warps = rms_norm._tile(hidden)
        consts = dict(ROWS=rows, BLOCK=block)
        stats = {"rstd_ptr": "*fp32", "eps": "fp32"}
        assert compile_for_sm90(rms_norm._forward_kernel, dtype, consts, warps, **stats)
        stats = {"rstd_ptr": "*fp32", "dw_ptr": "*fp32"}
        assert compile_for_sm90(rms_norm._backward_kernel, dtype, consts, warps, **stats)
    consts = dict(K=2, BLOCK=token_gather.BLOCK)
    assert compile_for_sm90(token_gather._sum_slots_kernel, dtype, consts, slots_ptr="*i64")
