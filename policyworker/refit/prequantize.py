"""MXFP8 refit prequantization: chosen HF weights leave the trainer as float8_e4m3fn values, each
followed by its uint8 E8M0 scales under `<name>_scale_from_checkpoint` (the reference's names,
what vLLM's MXFP8 loader reads), so an FP8 engine loads them without quantizing.

The refit info is derived from the bf16 one without touching a tensor (the values keep their
shape, the scales have one entry per 32-wide block of the last dim), and the transports stay
byte movers: the layout simply has fp8 and uint8 slots. Each weight is quantized where it is
exported, after the TP gather and the pipeline broadcast, one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from policyworker.ops.mxfp8 import SCALE_SUFFIX, check_mxfp8_shape, quantize_mxfp8, scale_shape
from policyworker.refit.layout import RefitInfo


def check_prequantize(names: object, info: RefitInfo) -> frozenset[str]:
    """The names to prequantize, checked against the bf16 refit info: a list of distinct known
    floating-point weights whose last dim is a multiple of 32. `ValueError` names the first bad
    one; nothing changes."""
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"param_names: expected a list of HF weight names, got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError("param_names: a name is listed twice")
    for name in names:
        if name not in info:
            raise ValueError(f"param_names: {name!r} is not in the refit info")
        shape, dtype = info[name]
        if not dtype.is_floating_point:
            raise ValueError(f"param_names: {name} is {dtype}, not a floating-point weight")
        why = check_mxfp8_shape(tuple(shape))
        if why is not None:
            raise ValueError(f"param_names: {name} {tuple(shape)} cannot be MXFP8: {why}")
    return frozenset(names)


def prequantized_info(info: RefitInfo, names: frozenset[str]) -> RefitInfo:
    """`info` with each of `names` as float8_e4m3fn, its scales right after it (uint8)."""
    out: RefitInfo = {}
    for name, (shape, dtype) in info.items():
        if name not in names:
            out[name] = (shape, dtype)
            continue
        out[name] = (shape, torch.float8_e4m3fn)
        out[name + SCALE_SUFFIX] = (scale_shape(tuple(shape)), torch.uint8)
    return out


def prequantized(
    tensors: Iterable[tuple[str, torch.Tensor]], names: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream of (hf_name, tensor) in `prequantized_info` order: each of `names` quantized."""
    for name, tensor in tensors:
        if name not in names:
            yield name, tensor
            continue
        values, scales = quantize_mxfp8(tensor)
        yield name, values
        yield name + SCALE_SUFFIX, scales
