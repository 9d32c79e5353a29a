"""Small helpers of the packed (THD) layout used by the model, context parallelism and the
micro-batch plans alike: positions within packed sequences, host-to-device index copies that
do not stall the host, and rounding up to a multiple."""

from __future__ import annotations

import torch


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] position of each packed token within its sequence (0 at every boundary, also at
    the last one for any tokens after it). No host sync: each token's sequence start is the
    running maximum of the boundaries marked at their offsets."""
    cu = cu_seqlens.to(torch.long)
    marks = torch.zeros(total + 1, dtype=torch.long, device=cu.device)
    marks.scatter_(0, cu.clamp(max=total), cu)  # equal offsets carry equal values
    starts = torch.cummax(marks[:total], dim=0).values
    return torch.arange(total, device=cu.device) - starts


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without stalling the host: on CUDA a pinned,
    asynchronous copy (a pageable copy waits for the stream, and with it every queued kernel)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
