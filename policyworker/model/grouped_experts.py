"""The experts of an MoE layer computed with torch's grouped GEMM (`torch.nn.functional.grouped_mm`,
no Transformer Engine): one kernel for every expert's fc1 and one for fc2, where megatron's
SequentialMLP runs a small GEMM pair per expert in a Python loop.

`GroupedExperts` is a SequentialMLP — the same per-expert parameters, names, sharded checkpoint
layout, HF mapping and refit — whose forward stacks the local experts' weights and runs the
gated MLP on the token groups the dispatcher sorted by expert (`tokens_per_expert`). The stack is
a copy of the expert weights per micro-batch (its backward hands each expert its gradient), the
price of keeping SequentialMLP's layout. The arithmetic is SequentialMLP's: silu(gate) · up,
times the router probability, cast back to the activation dtype, then fc2.

`GroupedMoELayer` is megatron's MoELayer with these experts; where every expert is local (expert
parallel and expert tensor parallel 1, dropless, all-to-all dispatch) it routes through
`LocalTokenDispatcher`, which never reads the per-expert token counts back to the host: megatron's
dispatcher synchronized with the device once per MoE layer for them (for SequentialMLP's split and
for its sort by local expert, the identity on one rank), leaving the GPU idle while the host
caught up. It moves the tokens with gathers, without megatron's atomic adds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.ops.compiled import cuda_compiled
from policyworker.ops.token_gather import combine, dispatch, token_slots


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts on one grouped GEMM per projection."""

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        config = self.config
        if config.moe_apply_probs_on_input or config.fp8 or config.fp4:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        ends = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2I, H]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, H, I]
        hidden = F.grouped_mm(x, fc1.transpose(1, 2), offs=ends)
        rows = None
        if config.add_bias_linear:  # each row's expert's biases (gpt-oss), no host sync
            rows = expert_of_rows(ends, x.shape[0])
            hidden = hidden + torch.stack([e.linear_fc1.bias for e in self.local_experts])[rows]
        glu = (config.activation_func, config.activation_func_clamp_value, config.glu_linear_offset)
        inner = weighted_glu(hidden, permuted_probs, *glu)
        out = F.grouped_mm(inner, fc2.transpose(1, 2), offs=ends)
        if rows is not None:  # megatron's MLP: the fc2 bias scaled by the router weight
            bias = torch.stack([e.linear_fc2.bias for e in self.local_experts])[rows]
            out = out + bias * permuted_probs.unsqueeze(-1)
        return out, None


def expert_of_rows(ends: torch.Tensor, n: int) -> torch.Tensor:
    """The local expert of each of `n` rows sorted by expert (`ends`: each expert's cumulative
    end)."""
    rows = torch.arange(n, device=ends.device, dtype=ends.dtype)
    return torch.searchsorted(ends, rows, right=True).clamp_max(ends.shape[0] - 1)


@cuda_compiled
def weighted_glu(
    hidden: torch.Tensor,
    probs: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    clamp: float | None = None,
    offset: float = 0.0,
) -> torch.Tensor:
    """activation(gate) * (up + offset) times each row's router probability, in the
    activation's dtype (megatron MLP's arithmetic; gate clamped above and up both ways at
    `clamp`: gpt-oss). On GPU one fused pass forward and one backward; eagerly it was five
    passes over the strided halves of `hidden` and a concatenation of their gradients, ~7 ms
    of a 2.1B MoE train step's kernels on an H100."""
    gate, up = hidden.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    inner = activation(gate) * (up + offset if offset else up)
    return (inner * probs.unsqueeze(-1)).to(inner.dtype)


class LocalTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher where every expert is on this rank: the tokens are
    sorted by expert in megatron's order, and the per-expert counts stay on the device, where
    `GroupedExperts` reads them (its grouped GEMMs take device offsets). The sort by local
    expert after the exchange, and its inverse, are identities with one rank and are skipped.
    Tokens move to their experts and back by gathers (`ops.token_gather`), where megatron's
    `permute`/`unpermute` add atomically (its `index_add_` backward and `scatter_add_`)."""

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        # megatron's order: by expert, then by token (routing_map has exactly top-k per token)
        order = routing_map.T.reshape(-1).argsort(descending=True, stable=True)
        order = order[: self.num_out_tokens]
        self.rows = order % tokens.shape[0]
        self.slots = token_slots(self.rows, tokens.shape[0], self.config.moe_router_topk)
        return dispatch(tokens, self.rows, self.slots), probs.T.reshape(-1)[order]

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return combine(hidden_states, self.rows, self.slots).view(self.hidden_shape)

    def _maybe_dtoh_and_synchronize(
        self, point: str, tokens_per_expert: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return tokens_per_expert

    def dispatch_postprocess(
        self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


class GroupedMoELayer(MoELayer):
    """MoELayer whose dispatcher is `LocalTokenDispatcher` where that is exact: all-to-all
    dispatch, one expert-parallel and one expert-tensor-parallel rank, no token dropping or
    padding, no shared-expert overlap; megatron's own dispatcher otherwise."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MoESubmodules | None = None,
        layer_number: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        **kwargs: object,
    ) -> None:
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        megatrons = self.token_dispatcher
        if (
            type(megatrons) is MoEAlltoAllTokenDispatcher
            and megatrons.ep_size == 1
            and megatrons.tp_size == 1
            and config.moe_expert_capacity_factor is None
            and not config.moe_router_padding_for_quantization
            and megatrons.shared_experts is None
        ):
            self.token_dispatcher = LocalTokenDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=config,
                pg_collection=pg_collection,
            )
