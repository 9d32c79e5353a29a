"""Sliding windows and learned sinks (gpt-oss) on flash attention: a GPU in half precision.

`Masked` (masked.py) builds a [heads, queries, keys] mask per call: exact, but its memory grows
with the square of a sequence's length. Here the window is flash's own (`window_size`) and the
sink goes through the softmax's log-sum-exp: with o and lse flash's output and log-sum-exp of a
query over its keys, and s_h the head's sink logit,

    out = o · w,    w = exp(lse) / (exp(lse) + exp(s_h)) = sigmoid(lse − s_h)

is softmax over [scores, s_h] with the sink's share dropped, exactly. Its backward needs no
kernel of its own: flash's backward forms dS = P ∘ (dO·Vᵀ − D) with D_i = dO_i · (the output
it is given); with dO = d_out · w and `out` itself in place of o, D_i = w_i · dO_i · o_i, which is
exactly the o-path's D minus the lse path's gradient (dL/dlse_i = (dO_i · o_i)(1 − w_i), and
dlse_i/dS_ij = P_ij). The sink's gradient is −Σ_i dL/dlse_i over the head's queries.

`SinkFlash` runs the padded and packed layouts this way; CP blocks keep `Masked`'s exact path.
The kernel pair is a small type (`VarlenFlash`: torch's flash varlen ops) so the algebra is
tested on the CPU against a reference pair (`tests/test_gpt_oss.py`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from policyworker.model.attention.layout import Packed
from policyworker.parallel.context import ContextPlan


class VarlenKernel(Protocol):
    """Causal attention over packed sequences [t, heads, d] (keys/values may have fewer heads),
    a query reaching `window` keys back (itself included; 0: all)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
        longest: int, scale: float, window: int,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:  # fmt: skip
        """(o [t, heads, d], lse [t, heads] fp32, whatever the backward needs)."""
        ...

    def backward(
        self, d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, cu: torch.Tensor, longest: int, scale: float,
        window: int, saved: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(dq, dk, dv) with D_i = d_o_i · out_i (flash's backward)."""
        ...


class VarlenFlash:
    """torch's flash varlen forward and backward ops (CUDA, bf16/fp16; `torch_attn`'s ops are
    registered by importing `torch.nn.attention.varlen`)."""

    def __init__(self) -> None:
        import torch.nn.attention.varlen  # noqa: F401

    def forward(self, q, k, v, cu, longest, scale, window):  # type: ignore[no-untyped-def]
        out, lse, rng = torch.ops.torch_attn._varlen_attn(
            q, k, v, cu, cu, longest, longest, window == 0, scale, _window(window)
        )
        return out, lse.transpose(0, 1), rng  # flash's lse is [heads, t]

    def backward(self, d_o, q, k, v, out, lse, cu, longest, scale, window, saved):  # type: ignore[no-untyped-def]
        return torch.ops.torch_attn._varlen_attn_backward(
            d_o, q, k, v, out, lse.transpose(0, 1).contiguous(), cu, cu, longest, longest,
            window == 0, saved, scale, _window(window),
        )  # fmt: skip


def _window(window: int) -> list[int]:
    """flash's (left, right): left counts the keys before the query."""
    return [window - 1 if window else -1, 0]


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
        cu: torch.Tensor, longest: int, scale: float, window: int, kernel: VarlenKernel,
    ) -> torch.Tensor:  # fmt: skip
        o, lse, saved = kernel.forward(q, k, v, cu, longest, scale, window)
        acc = torch.promote_types(o.dtype, torch.float32)  # half precision: in fp32
        w = torch.sigmoid(lse.to(acc) - sinks.to(acc))  # [t, heads]
        out = (o.to(acc) * w[..., None]).to(o.dtype)
        ctx.save_for_backward(q, k, v, out, lse, w, cu)
        ctx.args, ctx.saved = (longest, scale, window, kernel, sinks.dtype), saved
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, w, cu = ctx.saved_tensors
        longest, scale, window, kernel, sink_dtype = ctx.args
        d_o = (d_out.to(w.dtype) * w[..., None]).to(d_out.dtype)
        dq, dk, dv = kernel.backward(d_o, q, k, v, out, lse, cu, longest, scale, window, ctx.saved)
        # each query's gradient of its lse: (d_out · out)(1 − w) = (dO · o)(1 − w)
        d_lse = (d_out.to(w.dtype) * out.to(w.dtype)).sum(-1) * (1 - w)
        d_sinks = (-d_lse.sum(0)).to(sink_dtype)
        return dq, dk, dv, d_sinks, None, None, None, None, None


class SinkFlash:
    """A window and/or sinks on flash (module docstring); CP blocks by `exact`'s masks."""

    def __init__(
        self, window: int, sinks: torch.nn.Parameter | None, exact: Any, kernel: VarlenKernel
    ) -> None:
        self.window, self.sinks, self.exact, self.kernel = window, sinks, exact, kernel

    def padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [b, np, s, d], k/v [b, ng, s, d]: each row one sequence."""
        b, _, s, _ = q.shape
        cu = torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32)
        flat = [x.transpose(1, 2).reshape(b * s, *x.shape[1:2], x.shape[3]) for x in (q, k, v)]
        out = self._attend(*flat, cu, s, scale)
        return out.reshape(b, s, *out.shape[1:]).transpose(1, 2)

    def packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: Packed, scale: float
    ) -> torch.Tensor:
        """q/k/v [t, heads, d]; tokens after the last sequence get zeros."""
        cu, end = where.cu_q.int(), int(where.cu_q[-1])
        longest = int(where.params.max_seqlen_q or (cu[1:] - cu[:-1]).max())
        out = self._attend(q[:end], k[:end], v[:end], cu, longest, scale)
        return torch.cat([out, out.new_zeros(q.shape[0] - end, *out.shape[1:])])

    def split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextPlan, scale: float
    ) -> torch.Tensor:
        return self.exact.split(q, k, v, plan, scale)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
        longest: int, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        sinks = self.sinks if self.sinks is not None else q.new_full((q.shape[1],), -torch.inf)
        return _SinkAttention.apply(q, k, v, sinks, cu, longest, scale, self.window, self.kernel)
