"""RoPE of the queries and keys, with HF's exact frequencies (`set_rope`).

A module of its own in every attention layer, so that what leaves it (the queries and keys
that attention and a KV cache see) can be observed with hooks (FP8 calibration); it is called
for the queries, then the keys, in every forward that does not fuse RoPE into its cache write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from policyworker.ops import rope as rope_ops

Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""x, cos, sin -> x * cos + rotate_half(x) * sin."""

IN_PLACE_ROWS = 4096
"""A scoring forward over more rows (tokens) than this rotates its input in place, this many rows
at a time: at 128k tokens the rotated queries were the largest avoidable tensor of the peak.
Never in training: a recomputed layer's first, gradient-free pass must leave what it will
recompute from untouched."""


def rotate_for(device: torch.device, rotary_dim: int = 0, offset: int = 0) -> Rotate:
    """Our Triton kernel on a GPU, the torch ops (HF's, exact) on the CPU; `rotary_dim`: only
    so many of each head's features, from `offset` (0: all)."""
    rotate = rope_ops.rope if device.type == "cuda" else rope_ops.reference
    return Partial(rotate, offset, rotary_dim) if rotary_dim else rotate


@dataclass(frozen=True, slots=True)
class Partial:
    """RoPE on `dim` of each head's features from `start`, the rest passed through (GLM-4.5's
    `partial_rotary_factor`: the first half; MLA: the last `rope_dim`). The angles are `dim`
    wide."""

    rotate: Rotate
    start: int
    dim: int

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = self.start, self.start + self.dim
        return torch.cat((x[..., :a], self.rotate(x[..., a:b], cos, sin), x[..., b:]), dim=-1)


class Rotary(torch.nn.Module):
    """x * cos + rotate_half(x) * sin at given positions, cos/sin made in fp32 and cast to x's
    dtype, as HF and megatron do."""

    def __init__(self, rotate: Rotate = rope_ops.reference) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor | None = None  # not a buffer: no checkpoint or phase state
        self.attention_factor = 1.0
        self.rotate = rotate

    def set_frequencies(self, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> None:
        """RoPE at `inv_freq`, cos and sin scaled by `attention_factor` (YaRN's; else 1)."""
        self.inv_freq, self.attention_factor = inv_freq, attention_factor

    def forward(
        self,
        x: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        in_place: bool = False,
    ) -> torch.Tensor:
        """x rotated by `angles` (`angles()`, broadcast over x's head dims); `in_place`: written
        over x a chunk of rows at a time when x is long (what megatron hands over — its own copy
        of the queries, views of the QKV output for the keys — is read by nothing after)."""
        cos, sin = angles
        if not in_place or x.shape[0] <= IN_PLACE_ROWS:
            return self.rotate(x, cos, sin)
        n = x.shape[0]
        for a in range(0, n, IN_PLACE_ROWS):
            rows = slice(a, a + IN_PLACE_ROWS)
            c, s = (t[rows] if t.shape[0] == n else t for t in (cos, sin))
            x[rows] = self.rotate(x[rows], c, s)
        return x

    def angles(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at `positions` [..., 1], [..., head_dim] in `dtype`."""
        if self.inv_freq is None:
            raise RuntimeError("attention: set_rope() was not called")
        freqs = positions.unsqueeze(-1).float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN: scaled in fp32, before the cast, as in HF
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
