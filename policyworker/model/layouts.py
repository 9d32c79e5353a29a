"""How megatron holds each Hugging Face tensor: one mapping object per megatron parameter, naming
the HF tensors it is made of, in one of four layouts:

* `Copy`: same tensor (norms, embeddings, o_proj, down_proj, lm_head, routers, experts' down);
* `QKV`: q/k/v projections fused per query group, the layout megatron's `linear_qkv` uses:
  for each of the `ng` groups, `[q heads of the group, k, v]` stacked along dim 0;
* `GateUp`: `linear_fc1 = [gate; up]` (dense MLPs, experts, shared experts);
* `Parts`: several HF tensors stacked along dim 0, TP splitting each block on its own (a Gated
  DeltaNet layer's fused in-projection and its conv; `KeyHeadGroups`: Qwen3-Next's, whose HF
  tensors are fused per key head);
* `VocabRows`: embedding and output rows, padded to a multiple of TP.

Each converts full (unsharded) tensors both ways, exactly (export(import(w)) == w), and cuts or
joins tensor-parallel shards: TP splits each of a mapping's `blocks` along `tp_dim` on its own
(a rank holds `[block 0's shard r; block 1's shard r; ...]`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch

from policyworker.model.hf_config import ModelShape


@dataclass(frozen=True, slots=True)
class Copy:
    """One HF tensor is one megatron tensor; `tp_dim` is the dim split by TP (None: replicated)."""

    mcore: str
    hf: tuple[str, ...]
    tp_dim: int | None

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        return tensors[0]

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return [tensor]

    def blocks(self, full: int) -> tuple[int, ...]:
        """The lengths along `tp_dim` of the blocks TP splits each on its own (whole: one)."""
        return (full,)

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        if self.tp_dim is None or size == 1:
            return full
        dim = self.tp_dim
        blocks = full.split(self.blocks(full.shape[dim]), dim=dim)
        if len(blocks) == 1:
            return full.chunk(size, dim=dim)[rank]
        return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        dim, n = self.tp_dim, len(shards)
        per = [b // n for b in self.blocks(shards[0].shape[dim] * n)]
        if len(per) == 1:
            return torch.cat(shards, dim=dim)
        cut = [s.split(per, dim=dim) for s in shards]
        return torch.cat([c[b] for b in range(len(per)) for c in cut], dim=dim)


@dataclass(frozen=True, slots=True)
class QKV(Copy):
    """q, k, v projections (weight [*, hidden] or bias [*]) fused per query group."""

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        q, k, v = tensors
        ng, hd = shape.num_kv_heads, shape.head_dim
        rest = q.shape[1:]
        q = q.reshape(ng, shape.heads_per_group * hd, *rest)
        k = k.reshape(ng, hd, *rest)
        v = v.reshape(ng, hd, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        ng, hd, hpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
        rest = tensor.shape[1:]
        grouped = tensor.reshape(ng, (hpg + 2) * hd, *rest)
        q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
        return [x.reshape(-1, *rest) for x in (q, k, v)]

    # Groups are contiguous along dim 0, so TP shards are plain chunks (tp_dim=0).


@dataclass(frozen=True, slots=True)
class GatedQKV(Copy):
    """q (with its output gate), k, v projections fused per query group as megatron's gated
    attention (`attention_output_gate`) holds them: `[q heads, their gates, k, v]` per group.
    HF's q_proj gives each head's query, then its gate (Qwen3.5)."""

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        q_gate, k, v = tensors
        ng, hd, rest = shape.num_kv_heads, shape.head_dim, q_gate.shape[1:]
        pairs = q_gate.reshape(shape.num_heads, 2, hd, *rest)
        q, gate = (pairs[:, j].reshape(ng, shape.heads_per_group * hd, *rest) for j in (0, 1))
        parts = [q, gate, k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        ng, hd, hpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
        rest = tensor.shape[1:]
        grouped = tensor.reshape(ng, (2 * hpg + 2) * hd, *rest)
        q, gate, k, v = grouped.split([hpg * hd, hpg * hd, hd, hd], dim=1)
        heads = [x.reshape(shape.num_heads, 1, hd, *rest) for x in (q, gate)]
        q_gate = torch.cat(heads, dim=1).reshape(-1, *rest)
        return [q_gate, k.reshape(-1, *rest), v.reshape(-1, *rest)]


@dataclass(frozen=True, slots=True)
class GateUp(Copy):
    """`linear_fc1 = [gate; up]`; each TP rank holds `[gate_r; up_r]`."""

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        return torch.cat(tensors, dim=0)

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return list(tensor.chunk(2, dim=0))

    def blocks(self, full: int) -> tuple[int, ...]:
        return (full // 2, full // 2)


@dataclass(frozen=True, slots=True)
class Parts(Copy):
    """HF tensors stacked along dim 0 as blocks of `sizes` (each TP-split on its own); the HF
    tensor `i` holds `tensors[i]` consecutive blocks. A Gated DeltaNet layer's in-projection:
    blocks q, k, v, z, b, a from in_proj_qkv (3), in_proj_z, in_proj_b, in_proj_a."""

    sizes: tuple[int, ...] = ()
    tensors: tuple[int, ...] = ()

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        return torch.cat(tensors, dim=0)

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        ends = list(accumulate(self.tensors, initial=0))
        lengths = [sum(self.sizes[a:z]) for a, z in pairwise(ends)]
        return list(tensor.split(lengths, dim=0))

    def blocks(self, full: int) -> tuple[int, ...]:
        return self.sizes


@dataclass(frozen=True, slots=True)
class VocabRows(Copy):
    """Embedding / output rows: zero rows pad the vocabulary to `rows` (a multiple of TP); the
    HF side has exactly `vocab_size` rows."""

    rows: int = 0

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        full = tensors[0]
        pad = self.rows - full.shape[0]
        return torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return [tensor[: shape.vocab_size]]


@dataclass(frozen=True, slots=True)
class KeyHeadGroups(Parts):
    """Qwen3-Next's in-projections (`in_proj_qkvz`, `in_proj_ba`), fused per key head: for each
    key head, its q, k rows, then the v, z rows and the b, a rows of the value heads that read
    it. Held as `Parts`' blocks [q; k; v; z; b; a] (a permutation of rows, exact both ways)."""

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        net = shape.delta_net
        assert net is not None
        ratio = net.value_heads // net.key_heads
        qkvz = [net.key_dim, net.key_dim, ratio * net.value_dim, ratio * net.value_dim]
        parts = []
        for t, sizes in zip(tensors, (qkvz, [ratio, ratio]), strict=True):
            grouped = t.reshape(net.key_heads, sum(sizes), *t.shape[1:]).split(sizes, dim=1)
            parts += [p.reshape(-1, *t.shape[1:]) for p in grouped]
        return torch.cat(parts, dim=0)

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        assert shape.delta_net is not None
        heads, rest = shape.delta_net.key_heads, tensor.shape[1:]
        parts = [p.reshape(heads, -1, *rest) for p in tensor.split(self.sizes, dim=0)]
        return [torch.cat(parts[:4], dim=1).reshape(-1, *rest),
                torch.cat(parts[4:], dim=1).reshape(-1, *rest)]  # fmt: skip


Mapping = Copy | QKV | GateUp | Parts | VocabRows


@dataclass(frozen=True, slots=True)
class RopeRows(Copy):
    """A tensor whose rows come in blocks of `block` (a head's, or the whole tensor), each with
    `dim` RoPE rows from `start`. megatron's MLA reads RoPE features as interleaved pairs (it
    takes the even features, then the odd ones, before rotating halves), as DeepSeek-V3's
    checkpoints store them; a checkpoint with `rope_interleave: false` stores the halves, so
    its rows are interleaved on load and taken apart on export: a permutation, exact both ways."""

    block: int = 0
    start: int = 0
    dim: int = 0

    def _order(self, rows: int, *, to_mcore: bool) -> torch.Tensor:
        halves = torch.arange(self.dim).reshape(2, -1).t().reshape(-1)  # 0, d/2, 1, d/2 + 1, ...
        within = torch.arange(self.block)
        within[self.start : self.start + self.dim] = self.start + (
            halves if to_mcore else halves.argsort()
        )
        return (torch.arange(0, rows, self.block)[:, None] + within).reshape(-1)

    def to_mcore(self, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        return tensors[0][self._order(tensors[0].shape[0], to_mcore=True)]

    def to_hf(self, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return [tensor[self._order(tensor.shape[0], to_mcore=False)]]
