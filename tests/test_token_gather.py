"""Moving MoE tokens with gathers (`ops/token_gather.py`): the same numbers as megatron's
`permute`/`unpermute` (fp32 on the CPU: bitwise, forward and backward), adjoint to each other
(gradcheck), a bf16 sum rounded once (the exact sum's nearest bf16; megatron's bf16 atomics on the GPU round
after every add), and
the Triton kernel in Triton's interpreter against the torch sum (`token_gather_check.py`)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import in_interpreter
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from policyworker.ops.token_gather import combine, dispatch, token_slots

TOKENS, EXPERTS, TOPK, HIDDEN = 37, 8, 3, 16


def _routing(seed: int) -> torch.Tensor:
    """[TOKENS, EXPERTS] bool, exactly TOPK distinct experts per token (a top-k router's map)."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(TOKENS, EXPERTS, generator=g).topk(TOPK, dim=1).indices
    return torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter_(1, chosen, True)


def _ours(routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = routing.T.reshape(-1).argsort(descending=True, stable=True)[: TOKENS * TOPK]
    rows = order % TOKENS
    return rows, token_slots(rows, TOKENS, TOPK)


def test_dispatch_and_combine_equal_megatrons_permute_bitwise_in_fp32():
    routing = _routing(0)
    rows, slots = _ours(routing)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.float32)
    w = torch.randn(TOKENS * TOPK, HIDDEN)  # stands in for the experts: a per-row scale

    def run(ours: bool) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        if ours:
            out = combine(dispatch(leaf, rows, slots) * w, rows, slots)
        else:
            permuted, _, index, _, _ = permute(leaf, routing, num_out_tokens=TOKENS * TOPK)
            assert torch.equal(index, rows)  # the same expert order
            out = unpermute(permuted * w, index, restore_shape=leaf.shape, routing_map=routing)
        (out * torch.linspace(-1, 1, HIDDEN)).sum().backward()
        return out.detach(), leaf.grad

    (out, grad), (ref_out, ref_grad) = run(True), run(False)
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    assert torch.equal(rows[slots], torch.arange(TOKENS)[:, None].expand(TOKENS, TOPK))


def test_dispatch_and_combine_are_adjoint():
    rows, slots = _ours(_routing(1))
    x = torch.randn(TOKENS, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(TOKENS * TOPK, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: dispatch(t, rows, slots), (x,))
    assert torch.autograd.gradcheck(lambda t: combine(t, rows, slots), (y,))
    assert torch.autograd.gradgradcheck(
        lambda t: combine(dispatch(t, rows, slots), rows, slots), (x,)
    )


def test_bf16_combine_rounds_once():
    routing = _routing(2)
    rows, slots = _ours(routing)
    y = torch.randn(TOKENS * TOPK, 256).bfloat16()
    exact = combine(y.double(), rows, slots)
    ours = combine(y, rows, slots)
    theirs = unpermute(y, rows, restore_shape=torch.Size((TOKENS, 256)), routing_map=routing)
    assert torch.equal(ours, exact.bfloat16())  # the exact sum, rounded once
    assert (theirs.double() - exact).abs().sum() >= (ours.double() - exact).abs().sum()


@pytest.mark.processes
def test_kernel_equals_the_torch_sum_in_the_interpreter():
    result = json.loads(in_interpreter("token_gather_check.py")[-1])
    assert result["shape_ok"] and result["fp32_max_diff"] == 0.0
    # the interpreter rounds fp32 to bf16 by truncation (the GPU test checks bitwise)
    assert result["bf16_ulps"] <= 1.0
