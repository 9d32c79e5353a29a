"""The full-vocabulary reverse KL of a student to a teacher, vocab-parallel and chunked.

    KL_i = sum_v p_s(v) (log p_s(v) - log p_t(v)),  p = softmax(logits_i / T)

at every position i (the distribution of token i+1). The student's logits are its `Head`
(`hidden @ W.T`, this TP rank's vocabulary rows); the teacher's are, for the same rows and the
same vocabulary columns, either its full-vocabulary logits (this rank's columns sliced out) or its
final hidden states times this rank's rows of its LM head (`TeacherRows`). Like `ops.logprobs`,
the logits are taken `chunk_tokens` rows at a time and only [N]-sized statistics survive a chunk:
the two log-normalizers reduce over TP (MAX, then SUM), then the KL's partial sums (SUM). The
backward recomputes each chunk's logits (both sides) and forms

    dKL_i / dz_s(v) = p_s(v) (log p_s(v) - log p_t(v) - KL_i) / T,

local to each rank's columns. The teacher gets no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from policyworker.ops.compiled import cuda_compiled
from policyworker.ops.logprobs import (
    Head,
    LogitOptions,
    all_reduce,
    chunk_logits,
    head_grads,
    spans,
    sum_exp,
    vocab_part,
    wide,
)


@dataclass(frozen=True, slots=True)
class TeacherRows:
    """A teacher's logits for the student's rows [N], not computed yet."""

    payload: torch.Tensor
    """[N, D]: final hidden states (D = the teacher's hidden size) or full-vocabulary logits."""
    heads: tuple[torch.Tensor, ...] = ()
    """Each teacher's LM-head rows for this rank's vocabulary columns [cols, D]; empty: the
    payload are logits."""
    which: torch.Tensor | None = None
    """[N]: the position in `heads` of each row's teacher (None: `heads[0]` for all)."""

    def logits(self, a: int, b: int, start: int, cols: int) -> torch.Tensor:
        """Rows a:b, this rank's columns [start, start + cols) of the vocabulary."""
        x = self.payload[a:b]
        if not self.heads:
            return x[:, start : start + cols]
        if len(self.heads) == 1 or self.which is None:
            return F.linear(x.to(self.heads[0].dtype), self.heads[0][:cols])
        out = x.new_empty((b - a, cols), dtype=self.heads[0].dtype)
        which = self.which[a:b]
        for t, w in enumerate(self.heads):
            rows = (which == t).nonzero().squeeze(1)
            out[rows] = F.linear(x[rows].to(w.dtype), w[:cols])
        return out


def _pair_lse(
    xs: torch.Tensor, xt: torch.Tensor, inv_t: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """[2, n]: the log-normalizers of the student's and the teacher's logits / T over the whole
    vocabulary (two reductions over TP for both)."""
    row_max = torch.stack([wide(xs.amax(-1)), wide(xt.amax(-1))]) * inv_t
    all_reduce(row_max, group, dist.ReduceOp.MAX)
    sums = torch.cat([sum_exp(xs, row_max[0], inv_t), sum_exp(xt, row_max[1], inv_t)])
    all_reduce(sums, group)
    return row_max + sums.log()


@cuda_compiled
def _kl_part(
    xs: torch.Tensor, lse_s: torch.Tensor, xt: torch.Tensor, lse_t: torch.Tensor, inv_t: float
) -> torch.Tensor:
    """[n]: sum over this rank's columns of p_s (log p_s - log p_t)."""
    ls = wide(xs) * inv_t - lse_s[:, None]
    lt = wide(xt) * inv_t - lse_t[:, None]
    return (torch.exp(ls) * (ls - lt)).sum(-1)


@cuda_compiled
def _kl_grad(
    xs: torch.Tensor,
    lse_s: torch.Tensor,
    xt: torch.Tensor,
    lse_t: torch.Tensor,
    kl: torch.Tensor,
    grad: torch.Tensor,
    inv_t: float,
) -> torch.Tensor:
    """d(grad . KL)/d(student logits): p_s (log p_s - log p_t - KL) / T, times the grad."""
    ls = wide(xs) * inv_t - lse_s[:, None]
    lt = wide(xt) * inv_t - lse_t[:, None]
    return (torch.exp(ls) * (ls - lt - kl[:, None]) * (grad * inv_t)[:, None]).to(xs.dtype)


class _ChunkedReverseKL(torch.autograd.Function):
    """KL [N] of softmax(hidden @ weight.T / T) to the teacher's, chunk by chunk; see the module
    docstring. `cols`: this rank's real vocabulary columns, the first of which is id `start`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor | None,
        teacher: TeacherRows,
        opts: LogitOptions,
        cols: int,
        start: int,
    ) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        inv_t = 1.0 / opts.temperature
        n = hidden.shape[0]
        parts = spans(n, opts.chunk_tokens)
        lse = hidden.new_empty((2, n), dtype=torch.promote_types(hidden.dtype, torch.float32))
        kl = lse.new_empty(n)
        kept = (None, None)
        for a, b in parts:
            xs = chunk_logits(hidden[a:b], weight, cols)
            xt = teacher.logits(a, b, start, cols)
            lse[:, a:b] = _pair_lse(xs, xt, inv_t, opts.tp_group)
            part = _kl_part(xs, lse[0, a:b], xt, lse[1, a:b], inv_t)
            all_reduce(part, opts.tp_group)
            kl[a:b] = part
            # one chunk: keep its logits for the backward; several: each is recomputed there
            kept = (xs, xt) if len(parts) == 1 else (None, None)
        ctx.save_for_backward(hidden, weight, *kept, lse, kl)
        ctx.teacher, ctx.opts, ctx.cols, ctx.start = teacher, opts, cols, start
        return kl

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, kept_s, kept_t, lse, kl = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None
        teacher, opts, cols, start = ctx.teacher, ctx.opts, ctx.cols, ctx.start

        def chunk_grad(a: int, b: int, xs: torch.Tensor) -> torch.Tensor:
            xt = kept_t if kept_t is not None else teacher.logits(a, b, start, cols)
            g = grad[a:b].contiguous()
            return _kl_grad(xs, lse[0, a:b], xt, lse[1, a:b], kl[a:b], g, 1.0 / opts.temperature)

        grads = head_grads(hidden, weight, kept_s, cols, opts.chunk_tokens, ctx.needs_input_grad)
        return (*grads(chunk_grad), None, None, None, None)


def reverse_kl(head: Head, teacher: TeacherRows, opts: LogitOptions) -> torch.Tensor:
    """KL(student || teacher) [B, S] fp32 at each position (unshifted: position i compares the
    distributions of token i+1), over the whole true vocabulary at temperature `opts.temperature`
    for both; differentiable in the student. `teacher` holds the same B * S rows."""
    b, s, _ = head.hidden.shape
    cols, start = vocab_part(head, opts)
    kl = _ChunkedReverseKL.apply(
        head.hidden.reshape(b * s, -1), head.weight, teacher, opts, cols, start
    )
    return kl.reshape(b, s)
