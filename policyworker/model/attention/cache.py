"""A KV cache for generation in the worker: storage only (allocate, write, read).

Keys are stored after RoPE (RoPE lives in our attention, not before it as in megatron's static
inference cache). Rows are right-padded prompts of different lengths, decoded in lockstep: the
prefill writes the padded prompts at positions 0..L-1 (a row's padding only writes slots that its
own later tokens overwrite before anything reads them); each decode step then writes one token
per row at that row's own position. Slots are zeros until written, so a masked slot never brings
NaN into attention. What attends to the cache is `model/attention/cached.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEY_BLOCK = 64
"""Key lengths a forward attends to are multiples of this: aligned masks, few shapes."""


@dataclass(slots=True)
class Step:
    """What the next forward feeds: each row's first new position [B] (int64, on the device),
    how many positions the queries may reach at most (a host int), and whether it is the
    prefill (every row from position 0)."""

    starts: torch.Tensor
    keys_used: int
    prefill: bool
    lengths: torch.Tensor | None = None
    """The prefill's prompt lengths [B] (on the device): where a recurrent layer's state stops."""


class KVCache:
    """Keys and values of a batch's rows, up to `capacity` positions each (rounded up to a
    multiple of `KEY_BLOCK`), per attention layer [B, kv_heads, capacity, head_dim] (values: their
    own head width, MLA's differs), made at the layer's first write."""

    def __init__(self, capacity: int) -> None:
        self.capacity = -(-capacity // KEY_BLOCK) * KEY_BLOCK
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(
        self, number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `number`'s (keys, values); made as zeros for keys and values like `key`,
        `value` [s, b, ng, hn]."""
        kv = self.layers.get(number)
        if kv is None:
            b, ng = key.shape[1:3]
            kv = self.layers[number] = (
                key.new_zeros(b, ng, self.capacity, key.shape[3]),
                value.new_zeros(b, ng, self.capacity, value.shape[3]),
            )
        return kv

    def write(
        self,
        number: int,
        key: torch.Tensor,
        value: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """New keys/values [s, b, ng, hn] at `positions` [s, b] of `rows` [s, b]."""
        keys, values = self.layer(number, key, value)
        keys[rows, :, positions] = key  # advanced indices first: [s, b, ng, hn]
        values[rows, :, positions] = value

    def read(self, number: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `number`'s keys and values at positions 0..n-1 (views)."""
        keys, values = self.layers[number]
        return keys[:, :, :n], values[:, :, :n]

    def reach(self, positions: int) -> int:
        """The key length a forward attends to when its queries reach `positions` positions:
        rounded up to a multiple of `KEY_BLOCK` (masked beyond)."""
        return min(self.capacity, -(-positions // KEY_BLOCK) * KEY_BLOCK)
