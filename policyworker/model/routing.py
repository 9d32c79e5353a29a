"""How many tokens each expert received in a training step: forward hooks on megatron's routers.

Every MoE layer's router returns its routing map (tokens x experts, True where a token goes to an
expert); the hook adds up each expert's real tokens (the micro-batch's padding mask leaves out
padding and fillers) in the forwards that build a backward (an `eval_mode` step counts none).
`take` sums the counts over every rank — pipeline stages hold different layers, data/context-
parallel ranks (and tensor-parallel ones under sequence parallelism) different tokens — and turns
them into the step's metrics; under router replay, also the fraction of replayed tokens whose
route is not the one the router would have chosen.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.moe_layer import MoELayer

from policyworker.model.replay import LayerReplay


class RouteCounts:
    """Tokens per expert per MoE layer since the last `take` (training forwards only)."""

    def __init__(self, model: GPTModel, *, num_layers: int, num_experts: int) -> None:
        config = model.config
        # without sequence parallelism the TP ranks route the same tokens
        self.copies = 1 if config.sequence_parallel else config.tensor_model_parallel_size
        device = next(model.parameters()).device
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.moe_layers = torch.zeros(num_layers, dtype=torch.bool, device=device)
        # replayed tokens, and those whose replayed route is not the router's own choice
        self.replayed = torch.zeros(2, dtype=torch.int64, device=device)
        self.routers: list[torch.nn.Module] = []
        for layer in model.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                self.moe_layers[layer.layer_number - 1] = True
                self.routers.append(layer.mlp.router)
                layer.mlp.router.register_forward_hook(self._counter(layer.layer_number - 1))

    def _counter(self, index: int) -> Any:
        def hook(router: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # megatron's activation recompute runs a layer's first forward without grad and its
            # recompute with: counting forwards with grad counts each token once either way
            if not (router.training and torch.is_grad_enabled()):
                return
            routing_map = output[1]  # [tokens, experts]
            padding = args[1] if len(args) > 1 else None  # MoELayer.route passes it positionally
            real = torch.ones_like(routing_map[:, 0]) if padding is None else ~padding.reshape(-1)
            self.counts[index] += (routing_map & real[:, None]).sum(dim=0)
            replay = router.router_replay
            if isinstance(replay, LayerReplay) and replay.differs is not None:
                self.replayed += torch.stack([real.sum(), (replay.differs & real).sum()])

        return hook

    def reset(self) -> None:
        self.counts.zero_()
        self.replayed.zero_()
        self._balance_total()  # dropped

    def _balance_total(self) -> torch.Tensor:
        """The load-balancing terms of this rank's routers since the last call (summed)."""
        total = self.counts.new_zeros((), dtype=torch.float64)
        for router in self.routers:
            balance = router.router_replay.balance if router.router_replay else None
            if balance is not None and balance.total is not None:
                total += balance.total.double()
                balance.total = None
        return total

    def take(self, loss_tokens: float) -> dict[str, float]:
        """The step's `moe_tokens_per_expert_min` / `_max` (over every MoE layer's experts) and
        `_cv` (each layer's std / mean over its experts, averaged over layers), and with a
        load-balancing loss `moe_aux_loss` (its value per MoE layer: the terms over the step's
        `loss_tokens`); collective over the world. The counts start again from zero."""
        balance = self._balance_total()
        total, replayed = self.counts.clone(), self.replayed.clone()
        self.reset()
        moe = self.moe_layers.to(torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            for t in (total, moe, replayed, balance):
                dist.all_reduce(t)
        per_layer = (total[moe > 0] // self.copies).double()
        if per_layer.numel() == 0:  # no MoE layer
            return {}
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
        if any(r.router_replay and r.router_replay.balance for r in self.routers):
            layers = per_layer.shape[0]
            out["moe_aux_loss"] = float(balance) / (loss_tokens + 1e-8) / layers
        return out
