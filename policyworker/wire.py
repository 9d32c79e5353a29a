"""How a message crosses between our own processes (a worker's answer to the driver, a
generation process's to its parent, commands to it): pickled bytes in which every tensor
travels as its raw bytes (host memory), rebuilt bit for bit on the other side. Below every
layer: the driver and the generation process use it alike.

Not torch's own tensor pickling: in a worker, megatron-core (0.19) has replaced the function that
rebuilds a pickled storage with its own, so the driver would import megatron-core (seconds, and
nothing it needs) to read the first logprobs; and torch writes each storage through `torch.save`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch


def pack(value: Any) -> bytes:
    """`value` pickled, each plain tensor (any device) as its host bytes, dtype and shape."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(value)
    return buffer.getvalue()


def unpack(blob: bytes) -> Any:
    return pickle.loads(blob)


def rebuild(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over `raw`'s bytes (uint8)."""
    if not raw.flags.writeable:
        raw = raw.copy()
    return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor:
            return NotImplemented
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return rebuild, (raw, str(t.dtype).removeprefix("torch."), tuple(t.shape))
