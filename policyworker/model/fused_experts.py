"""Experts that a family's checkpoints store fused (gpt-oss): one tensor per layer and
projection holding every expert, with biases —

    mlp.experts.gate_up_proj       [E, hidden, 2·ffn]  gate and up columns interleaved
    mlp.experts.gate_up_proj_bias  [E, 2·ffn]          likewise
    mlp.experts.down_proj          [E, ffn, hidden]
    mlp.experts.down_proj_bias     [E, hidden]

— and a biased router `mlp.router.weight` / `.bias`. megatron holds one SequentialMLP expert
each (`linear_fc1 = [gate; up]` rows, `linear_fc2`), so each expert's mapping names its slice of
the fused tensor by a name of ours, `mlp.experts.{e}.gate_up_proj` (`expert_slice` reads it
out of the fused tensor, `fuse` stacks the slices back on export: transformers loads the
fused names).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from policyworker.model.layouts import Copy, GateUp, Mapping

PROJECTIONS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_SLICE = re.compile(
    r"^(?P<block>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(PROJECTIONS) + ")$"
)


@dataclass(frozen=True, slots=True)
class InterleavedGateUp(GateUp):
    """One expert's fused gate/up columns ([hidden, 2·ffn] weight, `transposed`; or a [2·ffn]
    bias), gate and up interleaved (gate 0, up 0, gate 1, ...), as megatron's [gate; up] rows."""

    transposed: bool = False

    def to_mcore(self, tensors: list[torch.Tensor], shape: object) -> torch.Tensor:
        rows = tensors[0].T if self.transposed else tensors[0]
        return torch.cat([rows[0::2], rows[1::2]], dim=0)

    def to_hf(self, tensor: torch.Tensor, shape: object) -> list[torch.Tensor]:
        gate, up = tensor.chunk(2, dim=0)
        rows = torch.stack([gate, up], dim=1).reshape(tensor.shape)
        return [rows.T if self.transposed else rows]


@dataclass(frozen=True, slots=True)
class Transposed(Copy):
    """One expert's down projection: [ffn, hidden] on disk, megatron's [hidden, ffn]."""

    def to_mcore(self, tensors: list[torch.Tensor], shape: object) -> torch.Tensor:
        return tensors[0].T

    def to_hf(self, tensor: torch.Tensor, shape: object) -> list[torch.Tensor]:
        return [tensor.T]


def fused_mappings(m: str, block: str, num_experts: int) -> list[Mapping]:
    """Router and experts of one layer: megatron's names under `m` (`decoder.layers.{i}.mlp.`),
    HF's under `block` (`model.layers.{i}.mlp.`)."""
    out: list[Mapping] = [
        Copy(m + "router.weight", (block + "router.weight",), None),
        Copy(m + "router.bias", (block + "router.bias",), None),
    ]
    for e in range(num_experts):
        hf, ours = f"{block}experts.{e}.", f"{m}experts.local_experts.{e}."
        out += [
            InterleavedGateUp(ours + "linear_fc1.weight", (hf + "gate_up_proj",), 0, True),
            InterleavedGateUp(ours + "linear_fc1.bias", (hf + "gate_up_proj_bias",), 0),
            Transposed(ours + "linear_fc2.weight", (hf + "down_proj",), 1),
            Copy(ours + "linear_fc2.bias", (hf + "down_proj_bias",), None),
        ]
    return out


def fused_shapes(block: str, num_experts: int, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
    """The shape of each expert's slice of the fused tensors under `block`."""
    one = {"gate_up_proj": (hidden, 2 * ffn), "gate_up_proj_bias": (2 * ffn,),
           "down_proj": (ffn, hidden), "down_proj_bias": (hidden,)}  # fmt: skip
    return {f"{block}experts.{e}.{p}": s for e in range(num_experts) for p, s in one.items()}


def expert_slice(name: str) -> tuple[str, int] | None:
    """(fused tensor, expert) of one of our slice names; None: not one."""
    found = _SLICE.match(name)
    return None if found is None else (f"{found['block']}.{found['proj']}", int(found["e"]))


def fuse(
    pairs: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """An export's (name, tensor) pairs with each fused tensor's `num_experts` slices (in expert
    order) stacked into it; the other pairs pass through. A layer's slices are held until its
    last expert's arrives."""
    pending: dict[str, list[torch.Tensor]] = {}
    for name, tensor in pairs:
        where = expert_slice(name)
        if where is None:
            yield name, tensor
            continue
        fused, e = where
        parts = pending.setdefault(fused, [])
        assert e == len(parts), f"fuse: expert {e} of {fused} out of order"
        parts.append(tensor)
        if e + 1 == num_experts:
            yield fused, torch.stack(pending.pop(fused))
    assert not pending, f"fuse: experts missing from {sorted(pending)}"
