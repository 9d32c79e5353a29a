"""FP8 KV-cache scales from a calibration batch (the seed's `calibrate_qkv_fp8_scales`).

Forward hooks on every layer's core attention record, per forward (one micro-batch), the
largest |value| of the keys and queries after RoPE (what attention and a KV cache see) and of
the values. Per layer, the `percentile` of those per-forward maxima is taken on each rank, then
the maximum over all ranks (TP ranks hold other heads, CP and DP ranks other tokens, pipeline
stages other layers); the scale is that amax * `margin` / 448 (FP8 e4m3's largest value), keyed
by vLLM's parameter names as the reference returns them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention

from policyworker.model.attention.core import CoreAttention
from policyworker.model.linear_attention import GatedDeltaNet

FP8_E4M3_MAX = 448.0
KINDS = ("q", "k", "v")


class QKVAmax:
    """Hooks recording each attention forward's Q/K/V amax, by global layer (a context)."""

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        self.model = model
        self.samples: dict[str, list[list[torch.Tensor]]] = {
            kind: [[] for _ in range(num_layers)] for kind in KINDS
        }
        self._handles: list[Any] = []

    def __enter__(self) -> QKVAmax:
        for layer in self.model.decoder.layers:
            attention = layer.self_attention
            if isinstance(attention, GatedDeltaNet):  # no keys and values to cache
                raise ValueError(
                    "calibrate_qkv_fp8_scales: not supported yet for models with Gated DeltaNet "
                    "layers (Qwen3.5: only its full-attention layers have a KV cache)"
                )
            if not isinstance(attention, SelfAttention):  # MLA: its cache would hold latents
                raise ValueError(
                    "calibrate_qkv_fp8_scales: not supported for multi-head latent attention "
                    "(FP8 scales of per-head keys and values; an MLA engine caches latents)"
                )
            core = attention.core_attention
            assert isinstance(core, CoreAttention)
            index = layer.layer_number - 1
            calls = [0]  # Rotary runs on the queries, then the keys, in each forward

            def before(_: Any, args: tuple[Any, ...], i: int = index, n: list = calls) -> None:
                n[0] = 0
                self.samples["v"][i].append(args[2].detach().abs().amax().float())

            def rotated(
                _: Any, __: Any, out: torch.Tensor, i: int = index, n: list = calls
            ) -> None:
                self.samples["qk"[min(n[0], 1)]][i].append(out.detach().abs().amax().float())
                n[0] += 1

            self._handles.append(core.register_forward_pre_hook(before))
            self._handles.append(core.rotary.register_forward_hook(rotated))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def amax(self, percentile: float) -> torch.Tensor:
        """[layers, 3] (q, k, v): the `percentile` of each layer's per-forward maxima (the
        sample at rank round(p / 100 * (n - 1)) of the sorted n, as the reference), maxed over
        every rank; 0 where no forward ran."""
        out = torch.zeros(len(self.samples["q"]), len(KINDS))
        for col, kind in enumerate(KINDS):
            for layer, values in enumerate(self.samples[kind]):
                if values:
                    ordered = torch.stack(values).cpu().sort().values
                    rank = round(percentile / 100.0 * (len(ordered) - 1))
                    out[layer, col] = ordered[max(0, min(len(ordered) - 1, rank))]
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = self.model.decoder.layers[0].self_attention.linear_qkv.weight.device
            reduced = out.to(device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            out = reduced.cpu()
        return out


def fp8_scales(
    amax: torch.Tensor, *, percentile: float, margin: float, include_q: bool
) -> dict[str, Any]:
    """The reference's result: `{"format": "fp8", "percentile", "margin", "layers": {vLLM
    parameter name: scale}}` (K and V scales of every layer; Q's with `include_q`)."""
    layers: dict[str, float] = {}
    for i, (q, k, v) in enumerate(amax.tolist()):
        if include_q:
            layers[f"model.layers.{i}.self_attn.attn.q_scale"] = q * margin / FP8_E4M3_MAX
        layers[f"model.layers.{i}.self_attn.k_scale"] = k * margin / FP8_E4M3_MAX
        layers[f"model.layers.{i}.self_attn.v_scale"] = v * margin / FP8_E4M3_MAX
    return {"format": "fp8", "percentile": percentile, "margin": margin, "layers": layers}


def check_calibration(percentile: Any, margin: Any, include_q: Any) -> None:
    """Refuse bad calibration options by name (before any forward)."""
    ok = isinstance(percentile, int | float) and not isinstance(percentile, bool)
    if not (ok and 0 < percentile <= 100):
        raise ValueError(f"percentile: expected a number in (0, 100], got {percentile!r}")
    ok = isinstance(margin, int | float) and not isinstance(margin, bool)
    if not (ok and margin > 0 and margin != float("inf")):
        raise ValueError(f"margin: expected a finite number > 0, got {margin!r}")
    if not isinstance(include_q, bool):
        raise ValueError(f"include_q: expected true or false, got {include_q!r}")


def save_json(result: dict[str, Any], path: str | Path) -> None:
    """`result` as JSON at `path`, written whole or not at all (a temporary file renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(result, indent=2, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
