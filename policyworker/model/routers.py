"""An MoE model's routers, as one object (`Routers`): what they replay, the load-balancing loss
they add, the tokens they count, and the routes they record.

megatron-core's routers take a `RouterReplay` that picks the top-k; ours, one per MoE layer
(`LayerRouter`):

* replays the routes of the current micro-batch (`routed_experts`, as this rank's router sees
  its tokens), a token whose row is all -1 left to the router;
* adds the load-balancing loss of the experts it chose (`model/balance.py`: the variant is a
  type chosen once) to a training forward, over the micro-batch's segments: computed where it
  chooses, attached to the router's output weights (a sigmoid router with the expert bias
  discards what the choice returns);
* in the backward, replays the same again, micro-batch by micro-batch in forward order, for the
  forwards that activation recompute repeats (pipeline schedules run later micro-batches'
  forwards in between: each layer keeps a queue, as megatron's own replay-backward does);
* always records the routes it used, and whether a replayed route differs from the router's own
  choice (the step's `moe_replay_route_differs_fraction`);
* counts each expert's real tokens in a training forward (not in its recompute): the step's
  `moe_tokens_per_expert_*` metrics.

`Routers` moves per-token values between the batch's layout ([b, t, ...] of the model's input:
padded rows or a packed bin, this CP rank's tokens) and each router's (the sequence-major tokens
of this TP rank's share under sequence parallelism).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay

from policyworker.model.balance import AttachLoss, Balance, balance_term
from policyworker.model.router_rules import RouterRule, TopK


@dataclass(frozen=True, slots=True)
class RouterInputs:
    """What one micro-batch's forward gives a router, in its token order."""

    routes: torch.Tensor | None = None
    """[tokens, K] experts to use (rows of -1: the router chooses); None: the router chooses."""
    segments: torch.Tensor | None = None
    """[tokens] each token's load-balancing segment (-1: padding); None: no balancing loss."""
    num_segments: int = 0
    counted: bool = False
    """A training forward's first pass: its tokens count towards the step's expert loads."""


class LayerRouter(RouterReplay):
    """One router's extension (see the module docstring). Not in megatron's global registry:
    each model owns its own."""

    def __init__(
        self,
        balance: Balance,
        group: dist.ProcessGroup | None,
        rule: RouterRule,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.balance, self.group, self.rule, self.bias = balance, group, rule, bias
        """The loss variant, the group sharing a segment's tokens, how the top k are chosen
        and the router's expert bias (None: none)."""
        self.pending: torch.Tensor | None = None  # the loss term of the current forward
        self.balance_scale = 1.0  # the step's gradient scale of the loss
        self.balance_total: torch.Tensor | None = None  # the step's terms so far (detached)
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
        self.pending = None
        self.recorded_topk_idx = None

    @property
    def counting(self) -> bool:
        return self.current.counted and not self.backward

    def get_replay_topk(  # type: ignore[override]
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        values, chosen = self.rule.choose(scores, topk, default_compute_topk)
        inputs = self.queue.popleft() if self.backward else self.current
        used, self.differs = chosen, None
        if inputs.routes is not None:
            own = (inputs.routes < 0).any(-1, keepdim=True)  # all -1: left to the router
            used = torch.where(own, chosen, inputs.routes.to(chosen.device))
            self.differs = (used.sort(-1).values != chosen.sort(-1).values).any(-1)
            values = scores.gather(1, used)
        self.recorded_topk_idx = used
        if inputs.segments is not None:  # a training forward with a balancing loss
            self.pending = self._balance(scores, used, inputs)
        return values, used

    def _balance(
        self, scores: torch.Tensor, used: torch.Tensor, inputs: RouterInputs
    ) -> torch.Tensor:
        """The forward's loss term, scaled for the step's gradient."""
        assert inputs.segments is not None
        probs = self.rule.balance_probs(scores, self.bias)
        coeff, count = self.balance.coeff, inputs.num_segments
        term = balance_term(probs, used, inputs.segments, count, coeff=coeff, group=self.group)
        if not self.backward:  # the step's metric counts a forward once, not its recompute
            total = self.balance_total
            self.balance_total = term.detach() if total is None else total + term.detach()
        return term * self.balance_scale

    def attach(self, output: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The router's (weights, routing map), the pending loss term attached to the weights."""
        if self.pending is None:
            return output
        probs, routing_map = output
        term, self.pending = self.pending, None
        return AttachLoss.apply(probs, term), routing_map


class Routers:
    """The routers of one model's MoE layers on this pipeline stage. `num_layers`: the MoE
    layers of the whole model (`routed_experts`' L axis); `topk`, `experts` per layer."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        moe_layers: tuple[bool, ...],
        topk: int,
        experts: int,
        balance: Balance,
        rule: RouterRule,
    ) -> None:
        config = self.config = model.config
        self.tp = config.tensor_model_parallel_size
        self.num_layers, self.topk, self.experts = sum(moe_layers), topk, experts
        self.balance = balance
        ordinal = torch.tensor(moe_layers).cumsum(0) - 1  # a global layer's place among MoE's
        # without sequence parallelism the TP ranks route the same tokens
        self.copies = 1 if config.sequence_parallel else self.tp
        device = next(model.parameters()).device
        self.counts = torch.zeros(len(moe_layers), experts, dtype=torch.int64, device=device)
        self.moe_layers = torch.tensor(moe_layers, dtype=torch.bool, device=device)
        # replayed tokens, and those whose replayed route is not the router's own choice
        self.replayed = torch.zeros(2, dtype=torch.int64, device=device)
        self.layers: dict[int, LayerRouter] = {}
        for layer in model.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                router = layer.mlp.router
                group = router.tp_cp_group  # the ranks that share a segment's tokens
                mine = LayerRouter(self.balance, group, rule, router.expert_bias)
                router.router_replay = mine
                self.layers[int(ordinal[layer.layer_number - 1])] = mine
                router.register_forward_hook(self._after(layer.layer_number - 1, mine))

    # --- each forward -------------------------------------------------------------------------

    def begin(
        self,
        routes: torch.Tensor | None,
        segments: tuple[torch.Tensor, int] | None,
        *,
        training: bool,
    ) -> None:
        """Before a micro-batch's forward: its routes [b, t, L, K] and balancing segments
        ([b, t], their number) in the model's input layout (None: the routers choose; no loss);
        a `training` forward's tokens are counted."""
        local = None if routes is None else self._to_router(routes)
        seg = None if segments is None else self._to_router(segments[0])
        count = 0 if segments is None else segments[1]
        for index, layer in self.layers.items():
            layer_routes = None if local is None else local[:, index]
            inputs = RouterInputs(layer_routes, seg if training else None, count, training)
            layer.set_inputs(inputs, training=training)

    def end_forward(self) -> None:
        """After a micro-batch's forward: router calls from here to the next `begin` are
        activation recompute in a backward, which replays the queued inputs in order."""
        for layer in self.layers.values():
            layer.backward = True

    def recorded(self, shape: tuple[int, int]) -> torch.Tensor:
        """The routes the last forward used, [b, t, L, K] in the model's input layout (`shape`
        is [b, t]); -1 for the MoE layers of other pipeline stages."""
        b, t = shape
        out = torch.full((b, t, self.num_layers, self.topk), -1, dtype=torch.long)
        for index, layer in self.layers.items():
            used = layer.recorded_topk_idx
            assert used is not None
            out = out.to(used.device)
            out[:, :, index] = self._from_router(used, b)
        return out

    def reset(self) -> None:
        """The end of a run of the schedule: no inputs, no queue."""
        for layer in self.layers.values():
            layer.reset()

    # --- each step ----------------------------------------------------------------------------

    def set_balance_scale(self, scale: float) -> None:
        """The gradient scale of the load-balancing losses in the coming forwards."""
        for layer in self.layers.values():
            layer.balance_scale = scale

    def reset_counts(self) -> None:
        self.counts.zero_()
        self.replayed.zero_()
        self._balance_total()  # dropped

    def take(self, loss_tokens: float) -> dict[str, float]:
        """The step's `moe_tokens_per_expert_min` / `_max` (over every MoE layer's experts) and
        `_cv` (each layer's std / mean over its experts, averaged over layers), and with a
        load-balancing loss `moe_aux_loss` (its value per MoE layer: the terms over the step's
        `loss_tokens`); collective over the world. The counts start again from zero."""
        balance = self._balance_total()
        total, replayed = self.counts.clone(), self.replayed.clone()
        self.reset_counts()
        moe = self.moe_layers.to(torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            for t in (total, moe, replayed, balance):
                dist.all_reduce(t)
        per_layer = (total[moe > 0] // self.copies).double()
        cv = per_layer.std(dim=1, correction=0) / per_layer.mean(dim=1).clamp_min(1e-12)
        stats = torch.stack(
            [per_layer.sum(), per_layer.min(), per_layer.max(), cv.mean(), *replayed.double()]
        )
        # one read back for all of it: each float() of a device scalar is a sync of its own
        routed, low, high, mean_cv, replay_tokens, differs = stats.tolist()
        if routed == 0:  # a forward-only step
            return {}
        out = {
            "moe_tokens_per_expert_min": low,
            "moe_tokens_per_expert_max": high,
            "moe_tokens_per_expert_cv": mean_cv,
        }
        if replay_tokens > 0:  # tokens of replayed forwards, over layers
            out["moe_replay_route_differs_fraction"] = differs / replay_tokens
        if self.balance.adds_loss:
            out["moe_aux_loss"] = float(balance) / (loss_tokens + 1e-8) / per_layer.shape[0]
        return out

    def _after(self, index: int, layer: LayerRouter) -> Any:
        """The router's forward hook: the forward's balancing loss attached to its weights,
        and in a training forward (not its recompute) its real tokens counted."""

        def hook(router: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            output = layer.attach(output)
            if not layer.counting:  # not a training forward, or its recompute
                return output
            routing_map = output[1]  # [tokens, experts]
            padding = args[1] if len(args) > 1 else None  # MoELayer.route passes it positionally
            real = torch.ones_like(routing_map[:, 0]) if padding is None else ~padding.reshape(-1)
            self.counts[index] += (routing_map & real[:, None]).sum(dim=0)
            if layer.differs is not None:
                self.replayed += torch.stack([real.sum(), (layer.differs & real).sum()])
            return output

        return hook

    def _balance_total(self) -> torch.Tensor:
        """The load-balancing terms of this rank's routers since the last call (summed)."""
        total = self.counts.new_zeros((), dtype=torch.float64)
        for layer in self.layers.values():
            if layer.balance_total is not None:
                total += layer.balance_total.double()
                layer.balance_total = None
        return total

    # --- layouts ------------------------------------------------------------------------------

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
