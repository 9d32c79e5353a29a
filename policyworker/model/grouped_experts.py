"""The experts of an MoE layer computed with torch's grouped GEMM (`torch.nn.functional.grouped_mm`,
no Transformer Engine): one kernel for every expert's fc1 and one for fc2, where megatron's
SequentialMLP runs a small GEMM pair per expert in a Python loop.

`GroupedExperts` is a SequentialMLP — the same per-expert parameters, names, sharded checkpoint
layout, HF mapping and refit — whose forward stacks the local experts' weights and runs the
gated MLP on the token groups the dispatcher sorted by expert (`tokens_per_expert`). The stack is
a copy of the expert weights per micro-batch (its backward hands each expert its gradient), the
price of keeping SequentialMLP's layout. The arithmetic is SequentialMLP's: silu(gate) · up,
times the router probability, cast back to the activation dtype, then fc2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts on one grouped GEMM per projection."""

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        config = self.config
        if config.moe_apply_probs_on_input or config.fp8 or config.fp4 or config.add_bias_linear:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        ends = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2I, H]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, H, I]
        hidden = F.grouped_mm(x, fc1.transpose(1, 2), offs=ends)
        gate, up = hidden.chunk(2, dim=-1)
        inner = config.activation_func(gate) * up
        inner = (inner * permuted_probs.unsqueeze(-1)).to(inner.dtype)
        return F.grouped_mm(inner, fc2.transpose(1, 2), offs=ends), None
