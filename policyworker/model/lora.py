"""LoRA: low-rank adapters on megatron's linear layers, the base frozen (`PeftConfig`).

An adapted layer computes W x + s · B A x (s = alpha / dim), the adapter a child module
(`adapter`: A [dim, in], B [out, dim]) whose forward hook adds its term to the layer's output —
so DDP, the optimizer and checkpoints see it as any parameter, and nothing else of the model
changes. Every other parameter is frozen (no gradient, no optimizer state). B starts at zero:
a fresh adapter leaves the base's outputs bit for bit.

`Adapters` holds them all: `off()` is the base itself — the reference policy with no second copy
of the weights (`BaseReference`) — and `merged(...)` the weights W + s · B A under the base's
names, computed as they are read (refit and HF export send merged weights; the trainer's own
stay as they are).

`peft_tensors` / `peft_config`: the adapters as a PEFT LoRA folder holds them, on HF's layers
(a fused layer's adapter becomes one per HF layer it holds: the same A, B's rows of that layer).

Not yet: tensor parallelism (the adapters would split as their base layer does), experts'
linear layers, adapters-only refit and checkpoints (issue #55).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from policyworker.config import PeftConfig
from policyworker.model.hf_config import ModelShape
from policyworker.model.weights import mappings

ADAPTER = ".adapter."
"""In a parameter's name: an adapter's (`adapter.lora_A`, `adapter.lora_B`)."""


class LoraAdapter(torch.nn.Module):
    """One layer's A and B; its hook adds s · B A x to the layer's output while `switch.on`."""

    def __init__(
        self, fan_in: int, fan_out: int, cfg: PeftConfig, dtype: torch.dtype, switch: Adapters
    ) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.empty(cfg.dim, fan_in, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.empty(fan_out, cfg.dim, dtype=dtype))
        self.scale = cfg.alpha / cfg.dim
        self.dropout = torch.nn.Dropout(cfg.dropout)
        self.pre = cfg.dropout_position == "pre"
        self.switch = switch

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(x) if self.pre else x
        out = F.linear(F.linear(h.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scale
        return (out if self.pre else self.dropout(out)).to(x.dtype)

    def hook(self, layer: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self.switch.on:
            return output
        out, bias = output
        return out + self.delta(args[0]), bias


class Adapters:
    """Whether a model's adapters are on (each adapter's hook reads it), and their scale."""

    def __init__(self, scale: float) -> None:
        self.on = True
        self.scale = scale

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """The base model until exit."""
        self.on = False
        try:
            yield
        finally:
            self.on = True

    def merged(
        self, weights: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """`weights` (the base's, by global name) with W + s · B A in place of each adapted
        weight, computed when read; `params`: every parameter by global name (the adapters'
        too)."""
        return _Merged(weights, _pairs(params), self.scale)


def _pairs(params: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted weight's global name -> its adapter's (A, B), from every parameter by
    global name."""
    return {
        name.removesuffix(f"{ADAPTER}lora_A") + ".weight": (
            params[name],
            params[name.removesuffix("lora_A") + "lora_B"],
        )
        for name in params
        if name.endswith(f"{ADAPTER}lora_A")
    }


class _Merged(Mapping[str, torch.Tensor]):
    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scale: float,
    ) -> None:
        self.weights, self.pairs, self.scale = weights, pairs, scale

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.weights[name]
        if name not in self.pairs:
            return w
        a, b = self.pairs[name]
        with torch.no_grad():
            return (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


class BaseReference:
    """The reference policy of a LoRA model: the base, its adapters off (no weights copied)."""

    def __init__(self, adapters: Adapters) -> None:
        self.adapters = adapters

    def swapped_into(self, params: object) -> contextlib.AbstractContextManager[None]:
        return self.adapters.off()


def attach(model: GPTModel, cfg: PeftConfig, seed: int) -> Adapters:
    """Adapters on the layers `cfg` names (not experts'), every other parameter frozen. Each
    adapter draws from its own generator, seeded by `seed` and its layer's global name: the
    same draws whatever the pipeline stage that holds it."""
    adapters = Adapters(cfg.alpha / cfg.dim)
    dtype = getattr(torch, cfg.lora_dtype) if cfg.lora_dtype else None
    chosen = cfg.modules()
    for block in model.decoder.layers:
        number = block.layer_number - 1  # global
        for name, layer in list(block.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in chosen or ".experts." in f".{name}.":
                continue
            if not isinstance(layer, ColumnParallelLinear | RowParallelLinear):
                continue
            weight = layer.weight
            adapter = LoraAdapter(
                weight.shape[1], weight.shape[0], cfg, dtype or weight.dtype, adapters
            )
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{number}.{name}".encode()))
            _init(adapter.lora_A, cfg.lora_A_init_method, g)
            _init(adapter.lora_B, cfg.lora_B_init_method, g)
            adapter.to(weight.device)
            layer.add_module("adapter", adapter)
            layer.register_forward_hook(adapter.hook)
    for name, p in model.named_parameters():
        p.requires_grad_(ADAPTER in f".{name}")
    if model.pre_process:
        # The embedding's output asks for a gradient, though no embedding weight does: full
        # recompute checkpoints each layer through an autograd function whose backward runs
        # only when an input wants a gradient, and the adapters inside get theirs from it.
        model.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    return adapters


def _init(p: torch.nn.Parameter, method: str, g: torch.Generator) -> None:
    """On the host with `g` (the same draws on every device), then copied in."""
    t = torch.empty(p.shape, dtype=torch.float32)
    if method == "xavier":
        torch.nn.init.xavier_normal_(t, generator=g)
    elif method == "kaiming":
        torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
    elif method == "normal":
        torch.nn.init.normal_(t, std=0.02, generator=g)
    else:
        t.zero_()
    with torch.no_grad():
        p.copy_(t)


def peft_tensors(params: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The adapters among `params` (every parameter by global name) under PEFT's names
    (`base_model.model.<HF layer>.lora_A.weight` [dim, in], `lora_B.weight` [out, dim]): a fused
    layer's A for each HF layer it holds, and B cut as the layer's weight is (q/k/v, gate/up)."""
    table = {m.mcore: m for m in mappings(shape)}
    out: dict[str, torch.Tensor] = {}
    for weight, (a, b) in _pairs(params).items():
        m = table[weight]
        for hf, rows in zip(m.hf, m.to_hf(b.detach(), shape), strict=True):
            at = "base_model.model." + hf.removesuffix(".weight")
            out[f"{at}.lora_A.weight"] = a.detach().clone()
            out[f"{at}.lora_B.weight"] = rows.contiguous()
    return out


def peft_config(cfg: PeftConfig, tensors: dict[str, torch.Tensor], base: str) -> dict[str, Any]:
    """`adapter_config.json` of `peft_tensors`' adapters."""
    layers = sorted({n.split(".")[-3] for n in tensors})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": cfg.dim, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": layers, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "use_rslora": False,
    }  # fmt: skip
