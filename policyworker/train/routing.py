"""What an MoE model's routers (`model.routers.Routers`) do in one run of the schedule: replay
each micro-batch's `routed_experts` or let every router choose, add the load-balancing loss in
training forwards, and keep the routes each forward used."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from policyworker.data.microbatch import Microbatch
from policyworker.model.routers import Routers


@dataclass(slots=True, kw_only=True)
class RouterRun:
    """One run's settings (`replay`, `record`, the balancing loss's gradient scale) and the
    routes it recorded."""

    routers: Routers
    replay: bool
    record: bool
    balance_scale: float = 1.0
    """The load-balancing losses' gradient scale (see `train.step`)."""
    recorded: list[torch.Tensor] = field(default_factory=list)
    """With `record`: each micro-batch's routes as [n, S, L, K] rows (this stage's layers)."""

    def before(self, mb: Microbatch, *, training: bool) -> None:
        routes = mb.routes() if self.replay else None
        segments = self.routers.balance.segments(mb) if training else None
        self.routers.set_balance_scale(self.balance_scale)
        self.routers.begin(routes, segments, training=training)

    def after(self, mb: Microbatch) -> None:
        self.routers.end_forward()
        if self.record:
            used = self.routers.recorded(mb.model_shape)
            self.recorded.append(mb.unpack(mb.gather(used + 1)) - 1)  # -1 past each length
