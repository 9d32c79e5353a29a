"""What our MoE routers add to megatron's: router replay (R3) and load-balancing losses.

megatron-core's routers take a `RouterReplay` that picks the top-k; ours, one per MoE layer
(`LayerReplay`):

* replays the routes of the current micro-batch (`routed_experts`, as this rank's router sees
  its tokens), a token whose row is all -1 left to the router;
* adds the load-balancing loss of the experts it chose (`model/balance.py`) to a training
  forward, over the micro-batch's segments (the micro-batch, or each sequence) — megatron's own
  `seq_aux_loss` assumes [S, B] rows and would treat a packed bin as one sequence;
* in the backward, replays the same again, micro-batch by micro-batch in forward order, for the
  forwards that activation recompute repeats (pipeline schedules run later micro-batches'
  forwards in between: each layer keeps a queue, as megatron's own replay-backward does);
* always records the routes it used, and whether a replayed route differs from the router's own
  choice (the step's `moe_replay_route_differs_fraction`).

`Replay` installs them on a model and moves per-token values between the batch's layout
([b, t, ...] of the model's input: padded rows or a packed bin, this CP rank's tokens) and each
router's (the sequence-major tokens of this TP rank's share under sequence parallelism).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay

from policyworker.model.balance import AttachLoss, balance_term

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class RouterInputs:
    """What one micro-batch's forward gives a router, in its token order."""

    routes: torch.Tensor | None = None
    """[tokens, K] experts to use (rows of -1: the router chooses); None: the router chooses."""
    segments: torch.Tensor | None = None
    """[tokens] each token's load-balancing segment (-1: padding); None: no balancing loss."""
    num_segments: int = 0


@dataclass(slots=True)
class Balance:
    """A layer's load-balancing loss: `coeff`, the group sharing a segment's tokens, whether the
    router's scores are already the softmax over all experts, and the step's gradient scale."""

    coeff: float
    group: dist.ProcessGroup | None
    pre_softmax: bool
    scale: float = 1.0
    total: torch.Tensor | None = None  # the step's terms so far (detached)


class LayerReplay(RouterReplay):
    """One router's extension (see the module docstring). Not in megatron's global registry:
    each model owns its own."""

    def __init__(self, balance: Balance | None) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.balance = balance
        self.queue: deque[RouterInputs] = deque()  # a step's inputs, for recomputed forwards
        self.current = RouterInputs()
        self.backward = False  # forwards now are recomputes (in a backward): take the queue's
        self.differs: torch.Tensor | None = None  # [tokens] bool, of the last forward

    def set_inputs(self, inputs: RouterInputs, *, training: bool) -> None:
        self.current, self.backward = inputs, False
        if training:
            self.queue.append(inputs)

    def reset(self) -> None:
        self.queue.clear()
        self.current, self.backward, self.differs = RouterInputs(), False, None
        self.recorded_topk_idx = None

    def get_replay_topk(  # type: ignore[override]
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        values, chosen = default_compute_topk(scores, topk, num_groups, group_topk)
        inputs = self.queue.popleft() if self.backward else self.current
        used, self.differs = chosen, None
        if inputs.routes is not None:
            own = (inputs.routes < 0).any(-1, keepdim=True)  # all -1: left to the router
            used = torch.where(own, chosen, inputs.routes.to(chosen.device))
            self.differs = (used.sort(-1).values != chosen.sort(-1).values).any(-1)
            values = scores.gather(1, used)
        self.recorded_topk_idx = used
        if self.balance is not None and inputs.segments is not None and torch.is_grad_enabled():
            values = self._add_balance(values, scores, used, inputs)
        return values, used

    def _add_balance(
        self, values: torch.Tensor, scores: torch.Tensor, used: torch.Tensor, inputs: RouterInputs
    ) -> torch.Tensor:
        b = self.balance
        assert b is not None and inputs.segments is not None
        probs = scores if b.pre_softmax else torch.softmax(scores, dim=-1, dtype=torch.float32)
        term = balance_term(
            probs, used, inputs.segments, inputs.num_segments, coeff=b.coeff, group=b.group
        )
        b.total = term.detach() if b.total is None else b.total + term.detach()
        return AttachLoss.apply(values, term * b.scale)


class Replay:
    """The router extensions of one model's MoE layers (on this pipeline stage)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        moe_layers: tuple[bool, ...],
        balance_coeff: float | None = None,
    ) -> None:
        config = self.config = model.config
        self.tp = config.tensor_model_parallel_size
        # the position of each global layer among the MoE layers (routed_experts' L axis)
        ordinal = torch.tensor(moe_layers).cumsum(0) - 1
        self.layers: dict[int, LayerReplay] = {}
        for layer in model.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                router = layer.mlp.router
                balance = None
                if balance_coeff is not None:
                    group = router.tp_cp_group  # the ranks that share a segment's tokens
                    balance = Balance(balance_coeff, group, config.moe_router_pre_softmax)
                router.router_replay = replay = LayerReplay(balance)
                self.layers[int(ordinal[layer.layer_number - 1])] = replay

    def begin(
        self,
        routes: torch.Tensor | None,
        segments: tuple[torch.Tensor, int] | None,
        *,
        training: bool,
    ) -> None:
        """Before a micro-batch's forward: its routes [b, t, L, K] and balancing segments
        ([b, t], their number) in the model's input layout (None: the routers choose; no loss)."""
        local = None if routes is None else self._to_router(routes)
        seg = None if segments is None else self._to_router(segments[0])
        count = 0 if segments is None else segments[1]
        for index, replay in self.layers.items():
            layer_routes = None if local is None else local[:, index]
            inputs = RouterInputs(layer_routes, seg if training else None, count)
            replay.set_inputs(inputs, training=training)

    def end_forward(self) -> None:
        """After a micro-batch's forward: router calls from here to the next `begin` are
        activation recompute in a backward, which replays the queued inputs in order."""
        for replay in self.layers.values():
            replay.backward = True

    def set_balance_scale(self, scale: float) -> None:
        """The gradient scale of the load-balancing losses in the coming forwards."""
        for replay in self.layers.values():
            if replay.balance is not None:
                replay.balance.scale = scale

    def recorded(self, shape: tuple[int, int], num_layers: int, topk: int) -> torch.Tensor:
        """The routes the last forward used, [b, t, L, K] in the model's input layout (`shape`
        is [b, t]); -1 for the MoE layers of other pipeline stages."""
        b, t = shape
        out = torch.full((b, t, num_layers, topk), -1, dtype=torch.long)
        for index, replay in self.layers.items():
            used = replay.recorded_topk_idx
            assert used is not None
            out = out.to(used.device)
            out[:, :, index] = self._from_router(used, b)
        return out

    def reset(self) -> None:
        for replay in self.layers.values():
            replay.reset()

    @property
    def sp(self) -> bool:
        """Sequence parallelism now (read live: generation switches it off for its forwards)."""
        return bool(self.config.sequence_parallel)

    def _to_router(self, values: torch.Tensor) -> torch.Tensor:
        """[b, t, ...] -> [tokens, ...] in a router's order: sequence-major, this TP rank's
        share of the sequence under sequence parallelism."""
        if self.sp and self.tp > 1:
            rank = dist.get_rank(_tp_group())
            values = values.chunk(self.tp, dim=1)[rank]
        return values.transpose(0, 1).reshape(-1, *values.shape[2:])

    def _from_router(self, used: torch.Tensor, b: int) -> torch.Tensor:
        """A router's [tokens, K] -> [b, t, K] (all-gathered over TP under SP)."""
        local = used.reshape(-1, b, used.shape[-1]).transpose(0, 1)  # [b, t / tp, K]
        if not (self.sp and self.tp > 1):
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local.contiguous(), group=_tp_group())
        return torch.cat(parts, dim=1)


def _tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()
