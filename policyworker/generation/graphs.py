"""A decode step as a CUDA graph: one token per row in, the logits [B, V] out.

A decode step of a small batch spends most of its time launching kernels from Python (some
800 launches through megatron's modules for a 22-layer model), not running them. Captured once
per `generate` call, a step is one graph replay. What the graph reads lives in static tensors
updated in place between replays — the fed tokens, each row's position (`Step.starts`) — and
the key length is the cache's whole capacity (the mask hides the unwritten slots), so every
step has the same shapes. Only for a model that runs whole on this GPU (no TP, PP or experts:
their collectives and token exchange are not captured here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphedStep:
    """`run()` captured: `replay()` runs it again on the current contents of its inputs."""

    _warmup: torch.cuda.Stream | None = None
    """One warm-up stream for every capture: cuBLAS keeps a 32 MiB workspace per stream it
    has seen, so a new stream per call would leave one behind each time."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        if GraphedStep._warmup is None:
            GraphedStep._warmup = torch.cuda.Stream()
        side = GraphedStep._warmup
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and allocate outside the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out
