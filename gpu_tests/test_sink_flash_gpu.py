"""gpt-oss's windows and sinks on flash attention (`attention/sink_flash.SinkFlash` over torch's
flash varlen ops, what training and scoring take on a GPU in half precision) against the exact
masked SDPA (`Masked`) in bf16: outputs and the gradients of q, k, v and the sinks, packed
sequences and padded rows, with and without a window."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from policyworker.model.attention.layout import Packed
from policyworker.model.attention.masked import Masked
from policyworker.model.attention.sink_flash import SinkFlash, VarlenFlash

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_sink_flash_matches_the_exact_masks_in_bf16(window, layout):
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [70, 130, 56]
    t = sum(lengths) + 8
    q = torch.randn(t, 8, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(t, 2, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    sinks = torch.randn(8, generator=g, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 70, 200, 256], device="cuda", dtype=torch.int32)
    pos = torch.cat([torch.arange(n, device="cuda") for n in [*lengths, 8]])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=130)
    where = Packed(pos[:, None], cu, cu, params)
    rows = [x[:256].reshape(2, 128, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]
    results = []
    for kernels_of in (lambda s: Masked(window, s), lambda s: SinkFlash(window, s, None, VarlenFlash())):  # fmt: skip
        leaves = [x.clone().requires_grad_() for x in (*(rows if layout == "padded" else (q, k, v)), sinks)]  # fmt: skip
        kernels = kernels_of(leaves[3])
        if layout == "padded":
            out = kernels.padded(*leaves[:3], 0.125)
        else:
            out = kernels.packed(*leaves[:3], where, 0.125)
        out.float().square().sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves)])
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), *results, strict=True):
        assert _rel(got, want) <= (2e-2 if name == "out" else 5e-2), name
