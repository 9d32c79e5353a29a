"""MXFP8 (OCP microscaling, E4M3 elements): float8_e4m3fn values with one power-of-two scale per
32 consecutive elements of the last dimension, stored as a biased uint8 exponent (E8M0).

    x ≈ values * 2^(scales - 127)    (each scale broadcast over its 32 values)

A block's exponent is the smallest e with amax / 2^e <= 448 (E4M3's largest finite value), so
no element saturates; then each element rounds to nearest-even in E4M3. The error of each
element is at most max(2^-4 |x|, 2^(e-10)): half a unit in the last place of a 3-bit mantissa,
or of E4M3's subnormal step 2^-9 near zero. An all-zero block gets exponent byte 1, not 0 (what
the reference does for FlashInfer/TRT-LLM kernels, which refuse byte 0); bytes stay in [1, 254]
(255 is E8M0's NaN).
"""

from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_from_checkpoint"
"""A weight's scales travel (refit) as `<weight name>_scale_from_checkpoint`, the reference's
name, which vLLM's MXFP8 loader reads."""
_BIAS = 127


def check_mxfp8_shape(shape: tuple[int, ...]) -> str | None:
    """Why a tensor of `shape` cannot be MXFP8 (None: it can)."""
    if not shape:
        return "a scalar has no last dimension to block"
    if shape[-1] % BLOCK:
        return f"its last dimension {shape[-1]} is not a multiple of {BLOCK}"
    return None


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 scales' shape of a tensor of `shape`: one per 32-wide block of the last dim."""
    return (*shape[:-1], shape[-1] // BLOCK)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values of `x`'s shape, uint8 E8M0 scales of `scale_shape`), on x's device.
    The last dimension must be a multiple of 32 (`check_mxfp8_shape`)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(1 - _BIAS, _BIAS)  # -inf: zeros
    scaled = blocks / torch.exp2(exponent)[..., None]
    # the clamp only guards log2's last-bit rounding (amax is at most 448 after scaling)
    values = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(x.shape), (exponent + _BIAS).to(torch.uint8)


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 `values * 2^(scales - 127)`, each scale over its 32 values."""
    blocks = values.float().reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK)
    return (blocks * torch.exp2(scales.float() - _BIAS)[..., None]).reshape(values.shape)


def mxfp8_error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per element, the largest |dequantized - x| the format allows (see the module docstring)."""
    step = torch.exp2(scales.float() - _BIAS - 10).repeat_interleave(BLOCK, dim=-1)
    return torch.maximum(x.float().abs() * 2.0**-4, step)
