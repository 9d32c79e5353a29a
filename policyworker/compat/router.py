"""megatron-core 0.19's padding mask at the routers, fixed (`install()`, idempotent):

1. `TopKRouter._apply_expert_bias` (sigmoid routers with `moe_router_enable_expert_bias`:
   DeepSeek-V3, GLM-4.5) masks padding out of the routing map as `routing_map & ~padding_mask`:
   the map is [tokens, experts] and the mask [tokens], so the mask broadcasts along the experts —
   a shape error, or, where tokens == experts, the wrong tokens dropped. Replaced with the same
   update, the mask taken per token (reached only where a router has the expert bias).
2. `GPTModel._preprocess` scatters the padding mask to this rank's sequence-parallel share only
   on the first pipeline stage (beside the embedding); a later stage passed its routers the
   whole mask beside their share of the tokens, and an MoE model crashed under TP + SP + PP
   ("size of tensor a (14) must match ... (28)"). A later stage's mask is scattered the same
   way (reached only with sequence parallelism, a padding mask, and no embedding on the stage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def _stage_mask(preprocess: Callable[..., Any]) -> Callable[..., Any]:
    """`GPTModel._preprocess` whose later pipeline stages scatter the padding mask [b, s] to
    their sequence-parallel share as the first stage does."""
    from megatron.core import tensor_parallel

    def _preprocess(self: Any, *args: Any, padding_mask: torch.Tensor | None = None, **kw: Any):
        if padding_mask is not None and self.config.sequence_parallel and not self.pre_process:
            padding_mask = (
                tensor_parallel.scatter_to_sequence_parallel_region(
                    padding_mask.transpose(0, 1).contiguous(), group=self.pg_collection.tp
                )
                .transpose(0, 1)
                .contiguous()
            )
        return preprocess(self, *args, padding_mask=padding_mask, **kw)

    return _preprocess


def install() -> None:
    global _installed
    if _installed:
        return
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router import TopKRouter

    require_mcore("router", "TopKRouter._apply_expert_bias, GPTModel._preprocess's padding_mask")
    TopKRouter._apply_expert_bias = _apply_expert_bias
    GPTModel._preprocess = _stage_mask(GPTModel._preprocess)
    _installed = True
