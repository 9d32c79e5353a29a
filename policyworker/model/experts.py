"""A mixture-of-experts layer's weights: the HF names of each family, their megatron rows, and the
fused layout some checkpoints store experts in.

On disk (what transformers 5 writes and inference engines read) every expert has its own
tensors: `mlp.experts.{e}.gate_proj / up_proj / down_proj` (Qwen2-MoE, Qwen3-MoE) or
`block_sparse_moe.experts.{e}.w1 / w3 / w2` (Mixtral), a router `gate.weight` [E, hidden], for
Qwen2-MoE a shared expert (`shared_expert.*`) and its sigmoid gate, for GLM-4.5 ungated shared
experts (`shared_experts.*`) and the router's expert bias `gate.e_score_correction_bias` [E]. transformers 5 holds them fused in memory —
`mlp.experts.gate_up_proj` [E, 2·ffn, hidden] and `mlp.experts.down_proj` [E, hidden, ffn] — and
a checkpoint saved in that layout is read too (`fused_source`). Exports use per-expert names.

megatron's MoELayer holds `mlp.router.weight` (and the buffer `mlp.router.expert_bias`),
`mlp.experts.local_experts.{e}.linear_fc1/2` (one SequentialMLP expert each) and
`mlp.shared_experts.linear_fc1/2` with `gate_weight` [1, hidden].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from policyworker.model.fused_experts import expert_slice, fused_mappings, fused_shapes
from policyworker.model.hf_config import GPT_OSS, ModelShape
from policyworker.model.layouts import Copy, GateUp, Mapping
from policyworker.model.router_rules import Sigmoid
from policyworker.parallel.dims import Groups


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """One family's HF names inside a decoder layer."""

    block: str
    """The MoE block's attribute (`mlp`, `block_sparse_moe`)."""
    gate: str
    up: str
    down: str
    shared: str = "shared_expert"
    """The shared expert's attribute in the block."""


_QWEN = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
_MIXTRAL = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
_GLM = ExpertNames(
    block="mlp", gate="gate_proj", up="up_proj", down="down_proj", shared="shared_experts"
)
EXPERT_NAMES: dict[str, ExpertNames] = {
    "DeepseekV3ForCausalLM": _GLM,  # the same names
    "MixtralForCausalLM": _MIXTRAL,
    "Qwen2MoeForCausalLM": _QWEN,
    "Qwen3MoeForCausalLM": _QWEN,
    "Qwen3_5MoeForCausalLM": _QWEN,
    "Qwen3NextForCausalLM": _QWEN,
    "Glm4MoeForCausalLM": _GLM,
}


def moe_mappings(i: int, shape: ModelShape) -> list[Mapping]:
    """The rows of layer `i`'s MoE block: router (and its expert bias), every expert in order,
    the shared expert."""
    moe = shape.moe
    assert moe is not None
    m, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}."
    if shape.architecture == GPT_OSS:  # stored fused, with biases (`fused_experts.py`)
        return fused_mappings(m, h + "mlp.", moe.num_experts)
    names = EXPERT_NAMES[shape.architecture]
    block = f"{h}{names.block}."
    out: list[Mapping] = [Copy(m + "router.weight", (block + "gate.weight",), None)]
    if isinstance(moe.rule, Sigmoid):
        out.append(Copy(m + "router.expert_bias", (block + "gate.e_score_correction_bias",), None))
    for e in range(shape.moe.num_experts):
        hf, ours = f"{block}experts.{e}.", f"{m}experts.local_experts.{e}."
        out += [
            GateUp(
                ours + "linear_fc1.weight",
                (f"{hf}{names.gate}.weight", f"{hf}{names.up}.weight"),
                0,
            ),
            Copy(ours + "linear_fc2.weight", (f"{hf}{names.down}.weight",), 1),
        ]
    if moe.shared_expert_ffn_size:
        shared = f"{h}mlp.{names.shared}."
        out += [
            GateUp(
                m + "shared_experts.linear_fc1.weight",
                (shared + "gate_proj.weight", shared + "up_proj.weight"),
                0,
            ),
            Copy(m + "shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), 1),
        ]
    if moe.shared_expert_gate:
        out.append(
            Copy(m + "shared_experts.gate_weight", (h + "mlp.shared_expert_gate.weight",), None)
        )
    return out


def expert_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for each per-expert HF tensor and router of the model."""
    moe = shape.moe
    if moe is None:
        return {}
    hidden, ffn = shape.hidden_size, moe.expert_ffn_size
    out: dict[str, tuple[int, ...]] = {}
    moe_layers = [i for i, is_moe in enumerate(moe.layers) if is_moe]
    if shape.architecture == GPT_OSS:
        for i in moe_layers:
            out |= fused_shapes(f"model.layers.{i}.mlp.", moe.num_experts, hidden, ffn)
        return out
    names = EXPERT_NAMES[shape.architecture]
    for i in moe_layers:
        block = f"model.layers.{i}.{names.block}."
        out[block + "gate.weight"] = (moe.num_experts, hidden)
        for e in range(moe.num_experts):
            hf = f"{block}experts.{e}."
            out[f"{hf}{names.gate}.weight"] = out[f"{hf}{names.up}.weight"] = (ffn, hidden)
            out[f"{hf}{names.down}.weight"] = (hidden, ffn)
    return out


_ROUTED = re.compile(r"^(?P<layer>decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(?P<e>\d+)\.")


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """Where a layer's routed experts live: expert parallel rank r holds experts
    [r * local, (r + 1) * local), each split along its ffn over the expert-TP group."""

    ep_rank: int
    ep_size: int
    local: int
    """Experts per EP rank."""

    @classmethod
    def of(cls, shape: ModelShape, groups: Groups | None) -> ExpertSplit:
        if groups is None or shape.moe is None:
            return cls(ep_rank=0, ep_size=1, local=shape.moe.num_experts if shape.moe else 0)
        return cls(groups.ep_rank, groups.ep_size, shape.moe.num_experts // groups.ep_size)

    def expert(self, mcore: str) -> int | None:
        """The routed expert megatron parameter `mcore` (global name) belongs to; None: none."""
        found = _ROUTED.match(mcore)
        return None if found is None else int(found["e"])

    def owner(self, mcore: str) -> int | None:
        """The EP rank holding routed-expert parameter `mcore`; None: not a routed expert's."""
        expert = self.expert(mcore)
        return None if expert is None else expert // self.local

    def stand_in(self, mcore: str) -> str:
        """This rank's expert in the same slot as routed-expert parameter `mcore`: the same
        shape and dtype, for receiving another rank's expert."""
        found = _ROUTED.match(mcore)
        assert found is not None, mcore
        e = self.ep_rank * self.local + int(found["e"]) % self.local
        return f"{found['layer']}{e}.{mcore[found.end() :]}"


_PER_EXPERT = re.compile(
    r"^(?P<layer>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_HALF = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": None, "w2": None}


@dataclass(frozen=True, slots=True)
class FusedSource:
    """Where a per-expert tensor lives in transformers' fused layout: `name`[expert], and of a
    `gate_up_proj` the gate (half 0) or up (half 1) rows."""

    name: str
    expert: int
    half: int | None

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        """This tensor out of its expert's rows of the fused tensor (a view)."""
        return rows if self.half is None else rows.chunk(2, dim=0)[self.half]


def fused_source(name: str) -> FusedSource | None:
    """The fused tensor a per-expert HF name is part of (None: not an expert tensor); gpt-oss's
    slice names (`fused_experts.py`) are their expert's whole row of the fused tensor."""
    if (where := expert_slice(name)) is not None:
        return FusedSource(where[0], where[1], None)
    found = _PER_EXPERT.match(name)
    if found is None:
        return None
    half = _HALF[found["proj"]]
    fused = "gate_up_proj" if half is not None else "down_proj"
    return FusedSource(f"{found['layer']}.mlp.experts.{fused}", int(found["e"]), half)


def transformers_view(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The part of a transformers model's tensors (`state_dict(keep_vars=True)`) that on-disk
    name `name` stands for: the tensor itself, Mixtral's under its in-memory block name, or an
    expert's rows of a fused tensor (a view: writing it writes the model). None: not there."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if name in state:
        return state[name]
    fused = fused_source(name)
    if fused is None or fused.name not in state:
        return None
    return fused.select(state[fused.name][fused.expert])
