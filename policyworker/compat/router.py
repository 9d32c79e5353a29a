"""megatron-core 0.19's count of each expert's tokens for the expert-bias update, fixed.

`TopKRouter._apply_expert_bias` (sigmoid routers with `moe_router_enable_expert_bias`: DeepSeek-V3,
GLM-4.5) masks padding out of the routing map as `routing_map & ~padding_mask`: the map is
[tokens, experts] and the mask [tokens], so the mask broadcasts along the experts — a shape error,
or, where tokens == experts, the wrong tokens dropped. `install()` replaces it with the same
update, the mask taken per token. Active only where a router has the expert bias (the method
is not reached otherwise); idempotent.
"""

from __future__ import annotations

import torch

from policyworker.compat.version import require_mcore

_installed = False


def _apply_expert_bias(
    self: torch.nn.Module, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> None:
    """Count each expert's real tokens for the bias update (not in gradient-free forwards:
    scoring, or a recomputed layer's first pass)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def install() -> None:
    global _installed
    if _installed:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    require_mcore("router", "TopKRouter._apply_expert_bias")
    TopKRouter._apply_expert_bias = _apply_expert_bias
    _installed = True
