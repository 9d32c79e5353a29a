"""Hugging Face <-> megatron weight names, and safetensors I/O.

The table is explicit: one mapping object per megatron parameter (`layouts.py`), naming the HF
tensors it is made of; an MoE layer's rows come from `experts.py`. Export is an iterator of
(hf_name, tensor) so that a refit transport or a safetensors writer can consume it without knowing
the layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open

from policyworker.model.experts import ExpertSplit, expert_shapes, fused_source, moe_mappings
from policyworker.model.fused_experts import expert_slice, fuse
from policyworker.model.hf_config import DeltaNetShape, ModelShape
from policyworker.model.layouts import (
    QKV,
    Copy,
    GatedQKV,
    GateUp,
    KeyHeadGroups,
    Mapping,
    Parts,
    RopeRows,
    VocabRows,
)
from policyworker.parallel.dims import Groups

__all__ = ["QKV", "Copy", "GateUp", "Mapping", "VocabRows", "mappings"]


def _latent_mappings(m: str, attn: str, shape: ModelShape) -> list[Mapping]:
    """Multi-head latent attention's projections and norms (megatron's MLASelfAttention)."""
    lat = shape.latent
    assert lat is not None
    head, a = lat.nope_dim + lat.rope_dim, m + "self_attention."
    rope = Copy if lat.interleaved else RopeRows  # interleaved: what megatron's MLA reads
    up = {} if lat.interleaved else dict(block=head, start=lat.nope_dim, dim=lat.rope_dim)
    if lat.q_lora_rank:
        out: list[Mapping] = [
            Copy(a + "linear_q_down_proj.weight", (attn + "q_a_proj.weight",), None),
            Copy(a + "q_layernorm.weight", (attn + "q_a_layernorm.weight",), None),
            rope(a + "linear_q_up_proj.weight", (attn + "q_b_proj.weight",), 0, **up),
        ]
    else:  # `q_lora_rank: null`: one projection, no norm
        out = [rope(a + "linear_q_proj.weight", (attn + "q_proj.weight",), 0, **up)]
    kv_rows = lat.kv_lora_rank + lat.rope_dim
    down = {} if lat.interleaved else dict(block=kv_rows, start=lat.kv_lora_rank, dim=lat.rope_dim)
    out += [
        rope(a + "linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",), None, **down),
        Copy(a + "kv_layernorm.weight", (attn + "kv_a_layernorm.weight",), None),
        Copy(a + "linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), 0),
    ]
    return out


def _layer_mappings(i: int, shape: ModelShape) -> list[Mapping]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    out: list[Mapping] = [Copy(m + "input_layernorm.weight", (h + "input_layernorm.weight",), None)]
    if shape.linear_layers and shape.linear_layers[i]:
        out += _delta_net_mappings(m + "self_attention.", h + "linear_attn.", shape.delta_net)
    else:
        out += _self_attention_mappings(m, h + "self_attn.", shape)
    out.append(Copy(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), None))
    if shape.moe is not None and shape.moe.layers[i]:
        return out + moe_mappings(i, shape)
    return out + _dense_mlp(m, h)


def _self_attention_mappings(m: str, attn: str, shape: ModelShape) -> list[Mapping]:
    out = _latent_mappings(m, attn, shape) if shape.latent else _attention_mappings(m, attn, shape)
    out.append(Copy(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), 1))
    if shape.arch.linear_bias:
        out.append(Copy(m + "self_attention.linear_proj.bias", (attn + "o_proj.bias",), None))
    if shape.sinks:
        out.append(Copy(m + "self_attention.core_attention.softmax_offset", (attn + "sinks",), 0))
    return out


def _delta_net_mappings(a: str, hf: str, net: DeltaNetShape) -> list[Mapping]:
    """A Gated DeltaNet layer's (`model/linear_attention.py`): its fused in-projection and conv
    split over TP block by block, its per-head parameters by heads, the norm whole."""
    if net.grouped_on_disk:
        ins = (hf + "in_proj_qkvz.weight", hf + "in_proj_ba.weight")
        in_proj: Mapping = KeyHeadGroups(a + "in_proj.weight", ins, 0, net.in_blocks, (4, 2))
    else:
        ins = tuple(hf + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
        in_proj = Parts(a + "in_proj.weight", ins, 0, net.in_blocks, (3, 1, 1, 1))
    return [
        in_proj,
        Parts(a + "conv_weight", (hf + "conv1d.weight",), 0, net.conv_blocks, (3,)),
        Copy(a + "A_log", (hf + "A_log",), 0),
        Copy(a + "dt_bias", (hf + "dt_bias",), 0),
        Copy(a + "norm_weight", (hf + "norm.weight",), None),
        Copy(a + "linear_proj.weight", (hf + "out_proj.weight",), 1),
    ]


def _attention_mappings(m: str, attn: str, shape: ModelShape) -> list[Mapping]:
    qkv = GatedQKV if shape.arch.output_gate else QKV
    out: list[Mapping] = [
        qkv(
            m + "self_attention.linear_qkv.weight",
            tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
            0,
        ),
    ]
    if shape.arch.qkv_bias:
        out.append(
            QKV(
                m + "self_attention.linear_qkv.bias",
                tuple(f"{attn}{p}_proj.bias" for p in "qkv"),
                0,
            )
        )
    if shape.arch.qk_norm:
        out += [
            Copy(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), None),
            Copy(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), None),
        ]
    return out


def _dense_mlp(m: str, h: str) -> list[Mapping]:
    return [
        GateUp(
            m + "mlp.linear_fc1.weight",
            (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
            0,
        ),
        Copy(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), 1),
    ]


def mappings(shape: ModelShape, tp: int = 1) -> list[Mapping]:
    """Every megatron parameter of the full model with its HF sources, in HF file order."""
    rows = shape.padded_vocab_size(tp)
    table: list[Mapping] = [
        VocabRows("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), 0, rows)
    ]
    for i in range(shape.num_layers):
        table += _layer_mappings(i, shape)
    table.append(Copy("decoder.final_layernorm.weight", ("model.norm.weight",), None))
    if not shape.tie_word_embeddings:
        table.append(VocabRows("output_layer.weight", ("lm_head.weight",), 0, rows))
    return table


def _tied_output(shape: ModelShape, tp: int) -> VocabRows:
    """With tied embeddings and pipeline parallelism the last stage holds its own copy of the
    embedding as the output layer (megatron keeps the two in sync); it loads from the embedding
    and is never exported (the first stage exports the one HF tensor)."""
    rows = shape.padded_vocab_size(tp)
    return VocabRows("output_layer.weight", ("model.embed_tokens.weight",), 0, rows)


LANGUAGE_MODEL = "model.language_model."
"""Where a vision-language checkpoint (`hf_config.VISION_LANGUAGE`) holds its text model's
`model.*` tensors."""


def text_names(names: Iterable[str]) -> dict[str, str]:
    """Our (the causal LM's) name of each tensor on disk -> its name there: the same names, or
    a vision-language checkpoint's text model (`model.language_model.*` as `model.*`, `lm_head`)
    without its vision tower."""
    names = list(names)
    if not any(n.startswith(LANGUAGE_MODEL) for n in names):
        return {n: n for n in names}
    text = {
        "model." + n.removeprefix(LANGUAGE_MODEL): n for n in names if n.startswith(LANGUAGE_MODEL)
    }
    return text | {n: n for n in names if n.startswith("lm_head.")}


class SafetensorsReader:
    """Reads named tensors from a HF folder: `model.safetensors` or a sharded index (a
    vision-language checkpoint's text model under our names: `text_names`)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = {name: folder / f for name, f in weight_map.items()}
        elif single.exists():
            with safe_open(single, framework="pt") as f:
                files = {name: single for name in f.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"{folder}: no model.safetensors or model.safetensors.index.json"
            )
        self._disk = text_names(files)
        """Our name -> the tensor's name on disk."""
        self._files = {ours: files[disk] for ours, disk in self._disk.items()}

    def names(self) -> set[str]:
        return set(self._files)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the 2-D tensor `name`, reading only those."""
        if name not in self._files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        with safe_open(self._files[name], framework="pt") as f:
            return f.get_slice(self._disk[name])[start:stop]

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`; a per-expert name is also read out of transformers' fused layout
        (only that expert's rows are read)."""
        if name in self._files:
            with safe_open(self._files[name], framework="pt") as f:
                return f.get_tensor(self._disk[name])
        fused = fused_source(name)
        if fused is None or fused.name not in self._files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        with safe_open(self._files[fused.name], framework="pt") as f:
            return fused.select(f.get_slice(self._disk[fused.name])[fused.expert])


def load_hf_weights(
    params: dict[str, torch.nn.Parameter],
    reader: SafetensorsReader,
    shape: ModelShape,
    groups: Groups | None = None,
) -> None:
    """Copy HF tensors into this rank's megatron parameters (`global_named_parameters`).

    Parameters absent from `params` (other pipeline stages, other EP ranks' experts) are
    skipped; a megatron parameter with no mapping, or a shape mismatch, is an error.
    """
    tp = 1 if groups is None else dist.get_world_size(groups.tp)
    table = {m.mcore: m for m in mappings(shape, tp)}
    if shape.tie_word_embeddings:
        tied = _tied_output(shape, tp)
        table[tied.mcore] = tied
    unmapped = sorted(set(params) - set(table))
    if unmapped:
        raise KeyError(f"no HF mapping for megatron parameters: {unmapped[:5]}")
    split = ExpertSplit.of(shape, groups)
    for name, param in params.items():
        m = table[name]
        full = m.to_mcore([reader.get(n) for n in m.hf], shape)
        local = m.shard(full, *_shard_place(m, split, groups))
        if local.shape != param.shape:
            raise ValueError(
                f"{name}: checkpoint gives {tuple(local.shape)}, model has {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(local.to(param.dtype))


def _shard_place(m: Mapping, split: ExpertSplit, groups: Groups | None) -> tuple[int, int]:
    """(rank, size) of this rank's shard of `m` along its TP dim: routed experts are split over
    the expert-TP group, everything else over TP."""
    if groups is None:
        return 0, 1
    if split.owner(m.mcore) is not None:
        return groups.etp_rank, groups.etp_size
    return groups.tp_rank, dist.get_world_size(groups.tp)


def _held(m: Mapping, params: dict[str, torch.Tensor], split: ExpertSplit) -> str | None:
    """The parameter of this rank that stands for `m`: its own, or for another EP rank's expert
    this rank's expert of the same slot (same shape); None: another pipeline stage's."""
    name = m.mcore if split.owner(m.mcore) is None else split.stand_in(m.mcore)
    return name if name in params else None


def full_meta(
    m: Mapping, params: dict[str, torch.Tensor], shape: ModelShape, groups: Groups | None
) -> torch.Tensor | None:
    """A meta tensor of `m`'s whole megatron tensor (shards and experts gathered); None: it is
    another pipeline stage's."""
    split = ExpertSplit.of(shape, groups)
    held = _held(m, params, split)
    if held is None:
        return None
    full = list(params[held].shape)
    if m.tp_dim is not None:
        full[m.tp_dim] *= _shard_place(m, split, groups)[1]
    return torch.empty(full, dtype=params[held].dtype, device="meta")


def export_hf_weights(
    params: dict[str, torch.Tensor],
    shape: ModelShape,
    groups: Groups | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) for the megatron parameters given (one pipeline stage's), full size.

    TP shards are all-gathered over TP (an expert's over expert TP), and each routed expert is
    broadcast by its EP rank, one at a time: every rank of the stage must iterate in step.
    Experts a family stores fused come out fused (`fused_experts.fuse`).
    """
    return on_disk(_export(params, shape, groups), shape)


def on_disk(
    pairs: Iterator[tuple[str, torch.Tensor]], shape: ModelShape
) -> Iterator[tuple[str, torch.Tensor]]:
    """An export's pairs under the names and layout the family's checkpoints use."""
    return fuse(pairs, shape.moe.num_experts) if shape.moe is not None else pairs


def _export(
    params: dict[str, torch.Tensor], shape: ModelShape, groups: Groups | None
) -> Iterator[tuple[str, torch.Tensor]]:
    tp = 1 if groups is None else dist.get_world_size(groups.tp)
    split = ExpertSplit.of(shape, groups)
    for m in mappings(shape, tp):
        held = _held(m, params, split)
        if held is None:
            continue
        tensor = params[held].detach()
        owner = split.owner(m.mcore)
        if owner is not None and split.ep_size > 1:
            assert groups is not None
            if owner != split.ep_rank:
                tensor = torch.empty_like(tensor)
            dist.broadcast(tensor, src=dist.get_global_rank(groups.ep, owner), group=groups.ep)
        rank_size = _shard_place(m, split, groups)
        if m.tp_dim is not None and rank_size[1] > 1:
            assert groups is not None
            group = groups.tp if owner is None else groups.etp
            shards = [torch.empty_like(tensor) for _ in range(rank_size[1])]
            dist.all_gather(shards, tensor.contiguous(), group=group)
            tensor = m.unshard(shards)
        yield from zip(m.hf, m.to_hf(tensor, shape), strict=True)


def check_hf_folder(folder: str | Path, hf_config: Any, shape: ModelShape, *, field: str) -> None:
    """Before any weight is read: every weight file complete (its header's tensors all within
    the file), and every tensor the model reads present with the shape its config.json implies.
    A `ValueError` names `field`, the file or the tensor."""
    found = _safetensors_headers(Path(folder), field)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()} | expert_shapes(shape)
    for name in (n for m in mappings(shape) for n in m.hf):
        if name not in found and (shape_in := _in_fused(name, found)) is not None:
            found[name] = shape_in
        where = name
        if (ours := expert_slice(name)) is not None:  # our name for a fused tensor's expert rows
            where = f"{name} (expert {ours[1]} of {ours[0]})"
        if name not in found:
            raise ValueError(f"{field}: {folder} has no tensor {where} (config.json needs it)")
        if found[name] != expected.get(name, found[name]):
            raise ValueError(
                f"{field}: {folder}: {where} has shape {list(found[name])}; config.json gives "
                f"{list(expected[name])} (do config.json and the weights belong together?)"
            )


def _in_fused(name: str, found: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape of per-expert tensor `name` held in a fused expert tensor of `found` (None: it is
    not there, or that expert is past the fused tensor's count)."""
    fused = fused_source(name)
    if fused is None or fused.name not in found:
        return None
    experts, *rows = found[fused.name]
    if fused.expert >= experts:
        return None
    return tuple(rows) if fused.half is None else (rows[0] // 2, *rows[1:])


def _safetensors_headers(folder: Path, field: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the headers of the folder's safetensors files, after checking
    each file holds every byte its header announces."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{field}: {index} does not parse ({e})") from None
    else:
        files = ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        path = folder / name
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n)) if 0 < n < (1 << 30) else None
            size = path.stat().st_size
        except (OSError, ValueError) as e:
            raise ValueError(f"{field}: {path} is not readable safetensors ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{field}: {path} is not a safetensors file (bad header)")
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = 8 + n + max((v["data_offsets"][1] for v in tensors.values()), default=0)
        if size < end:
            raise ValueError(f"{field}: {path} is truncated ({size} bytes; its header needs {end})")
        shapes.update({k: tuple(v["shape"]) for k, v in tensors.items()})
    return {ours: shapes[disk] for ours, disk in text_names(shapes).items()}
