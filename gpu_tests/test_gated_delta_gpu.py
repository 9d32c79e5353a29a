"""flash-linear-attention's gated delta rule (`ops/gated_delta.FlaRule`, taken on a GPU in half
precision when fla-core is installed) against our PyTorch chunked form: bf16 forward and
backward, rows and a pack whose sequences each start from zero (varlen), its padding zero."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fla.ops.gated_delta_rule")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

from policyworker.ops.gated_delta import FlaRule, TorchRule  # noqa: E402


def _inputs(b: int, t: int, h: int = 8, dk: int = 64, dv: int = 64) -> list[torch.Tensor]:
    g0 = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        x = torch.rand(*shape, generator=g0, device="cuda") * scale + shift
        return x

    q, k = (torch.randn(b, t, h, dk, generator=g0, device="cuda") for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g0, device="cuda")
    g, beta = rand(b, t, h, scale=-0.5), rand(b, t, h)
    return [x.bfloat16() if x.dim() == 4 or x is beta else x for x in (q, k, v, g, beta)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _run(rule, inputs, call):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = call(rule, leaves)
    out.float().square().mean().backward()
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("packed", [False, True])
def test_fla_rule_matches_ours_in_bf16(packed):
    inputs = _inputs(1 if packed else 2, 300)
    cu = [0, 100, 250]  # two sequences, then 50 padding tokens

    def call(rule, x):
        return rule(*x, cu if packed else None)

    want, want_grads = _run(TorchRule(), inputs, call)
    got, grads = _run(FlaRule(), inputs, call)
    assert _rel(got, want) <= 2e-2
    for a, b in zip(grads, want_grads, strict=True):
        assert _rel(a, b) <= 5e-2
    if packed:
        assert torch.equal(got[:, 250:], torch.zeros_like(got[:, 250:]))
