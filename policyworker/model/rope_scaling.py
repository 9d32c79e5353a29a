"""RoPE's frequencies from a Hugging Face config, exactly as transformers makes them.

`rope_type` "default" and "llama3" are computed here; "yarn" (DeepSeek-V3, Kimi-K2, Qwen3's long
context, gpt-oss) by transformers' own function, which also gives YaRN's `attention_factor` (cos
and sin are scaled by it). Latent attention also scales its softmax by YaRN's `mscale_all_dim`
(`softmax_mscale`); other attention does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from policyworker.model.errors import UnsupportedModelError

SUPPORTED = ("default", "llama3", "yarn")


@dataclass(frozen=True)
class RopeFrequencies:
    """Inverse frequencies [dim/2] (fp32) and the factor cos/sin are scaled by (YaRN's)."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings as transformers >= 5 spells them (`rope_parameters`), also from 4.x configs."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return scaling


def rope_type(hf_config: Any) -> str:
    """The config's `rope_type`, refused by name unless supported."""
    kind = rope_parameters(hf_config).get("rope_type", "default")
    if kind not in SUPPORTED:
        raise UnsupportedModelError(
            f"rope_type {kind!r} is not supported; supported: {', '.join(map(repr, SUPPORTED))}"
        )
    return kind


def rope_frequencies(hf_config: Any, dim: int) -> RopeFrequencies:
    """The frequencies of the `dim` features RoPE rotates (`ModelShape.rotary_dim` where it
    rotates part of each head)."""
    params = rope_parameters(hf_config)
    kind = rope_type(hf_config)
    if kind == "yarn":
        return _transformers_yarn(hf_config, dim)
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    return RopeFrequencies(inv_freq)


def softmax_mscale(hf_config: Any) -> tuple[float, float]:
    """(factor, mscale_all_dim) of DeepSeek's softmax scale, `(0.1 · mscale_all_dim · ln factor
    + 1)²` times 1/sqrt(head width) (transformers' `yarn_apply_mscale`; megatron's MLA computes
    it from the same two): (1, 0), no change, unless RoPE is scaled with `mscale_all_dim`."""
    params = rope_parameters(hf_config)
    if params.get("rope_type", "default") == "default" or not params.get("mscale_all_dim"):
        return 1.0, 0.0
    return float(params["factor"]), float(params["mscale_all_dim"])


def _transformers_yarn(hf_config: Any, dim: int) -> RopeFrequencies:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
    if inv_freq.numel() != dim // 2:  # transformers reads the width off the config
        raise UnsupportedModelError(
            f"rope_type 'yarn': transformers' frequencies cover {2 * inv_freq.numel()} features "
            f"of a head, the model rotates {dim}"
        )
    return RopeFrequencies(inv_freq.float(), float(attention_factor))


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent interpolation: long wavelengths slowed by `factor`."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
