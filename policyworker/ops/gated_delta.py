"""The gated delta rule — the linear attention of Gated DeltaNet layers (Qwen3.5, Qwen3-Next) —
in PyTorch, in fp32.

Per head a state S [dk, dv] carries the sequence: for each token t, with its query q_t and key
k_t (both L2-normalized, q also scaled by 1/√dk), its value v_t, decay g_t ≤ 0 (log space) and
write strength β_t ∈ (0, 1):

    S ← exp(g_t) · S
    S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t)          (the delta rule: write only what S mispredicts)
    o_t = Sᵀ q_t

`chunked` runs it a chunk of 64 tokens at a time in the UT/WY form (within a chunk the updates
become triangular solves and matmuls; one state carries across chunks), the algorithm of
transformers' `torch_chunk_gated_delta_rule`; `recurrent` token by token (a decode step).
Both start from a given state and return the last one, so a sequence can continue across calls
(generation, a pack's sequences each from zero). Inputs keep transformers' layout: [batch,
tokens, heads, dim], keys and queries already repeated to the value heads.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch
import torch.nn.functional as F

CHUNK = 64


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """fp32, heads before tokens, q/k normalized and q scaled."""
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _state(
    initial: torch.Tensor | None, b: int, h: int, dk: int, dv: int, like: torch.Tensor
) -> torch.Tensor:
    if initial is None:
        return torch.zeros(b, h, dk, dv, dtype=torch.float32, device=like.device)
    return initial.float()


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [b, s, h, dk], v [b, s, h, dv], g, beta [b, s, h]; `initial` state [b, h, dk, dv]
    (None: zeros) -> (out [b, s, h, dv] in v's dtype, last state [b, h, dk, dv] fp32)."""
    dtype, (b, s, h, dk), dv = v.dtype, k.shape, v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = -s % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (s + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, -1) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(b, h, n, chunk).cumsum(dim=-1)  # log decay from the chunk's start
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(above, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # unit lower triangular once solved
    within = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    state = _state(initial, b, h, dk, dv, q)
    out = torch.zeros_like(new_values)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    carried = decay[..., -1].exp()[..., None, None]
    for i in range(n):  # one state across chunks
        fresh = new_values[:, :, i] - k_decayed[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + within[:, :, i] @ fresh
        state = state * carried[:, :, i] + k[:, :, i].transpose(-1, -2) @ fresh
    out = out.reshape(b, h, -1, dv)[:, :, :s]
    return out.transpose(1, 2).contiguous().to(dtype), state


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked`'s arguments and results, token by token (decode steps: one token per row)."""
    dtype, (b, s, h, dk), dv = v.dtype, k.shape, v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = _state(initial, b, h, dk, dv, q)
    out = torch.zeros_like(v)
    for t in range(s):
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = (state * k[:, :, t, :, None]).sum(dim=-2)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), state


def packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int],
) -> torch.Tensor:
    """`chunked` over the sequences packed in one row ([1, t, ...] each), every sequence from a
    zero state (nothing crosses a boundary); tokens after the last sequence get zeros."""
    out = torch.zeros_like(v)
    for a, z in itertools.pairwise(cu_seqlens):
        if z > a:
            out[:, a:z] = chunked(q[:, a:z], k[:, a:z], v[:, a:z], g[:, a:z], beta[:, a:z])[0]
    return out


class DeltaRule(Protocol):
    """How a training or scoring forward runs the rule over whole sequences (each from a zero
    state), chosen once for a model (`model/paths.choose_paths`)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: list[int] | None,
    ) -> torch.Tensor:
        """Each row of [b, t, ...] one sequence (`cu_seqlens` None), or the sequences packed
        in one row (`packed`'s contract)."""
        ...


class TorchRule:
    """`chunked` and `packed` above: every device, fp32 inside (transformers' reference)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: list[int] | None,
    ) -> torch.Tensor:
        if cu_seqlens is None:
            return chunked(q, k, v, g, beta)[0]
        return packed(q, k, v, g, beta, cu_seqlens)


class FlaRule:
    """flash-linear-attention's chunked Triton kernels, forward and backward (`fla-core`, an
    optional dependency: `pip install '.[gpu]'`; CUDA, half precision). The same rule with the
    q/k L2 norm inside the kernel; a pack's sequences by `cu_seqlens` (varlen)."""

    def __init__(self) -> None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        self.kernel = chunk_gated_delta_rule

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: list[int] | None,
    ) -> torch.Tensor:
        if cu_seqlens is None:
            return self.kernel(q, k, v, g.float(), beta, use_qk_l2norm_in_kernel=True)[0]
        t, end = q.shape[1], cu_seqlens[-1]
        bounds = torch.tensor([*cu_seqlens, t] if end < t else cu_seqlens, device=q.device)
        out = self.kernel(
            q, k, v, g.float(), beta, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds
        )[0]
        return out if end == t else F.pad(out[:, :end], (0, 0, 0, 0, 0, t - end))


def fla_installed() -> bool:
    """Whether flash-linear-attention's kernels import here."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True
