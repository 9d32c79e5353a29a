"""The parts of multi-head latent attention (DeepSeek-V3) that megatron-core's local modules do
not give as transformers computes them: the latents' norms and the down-projections."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.model.norm import RMSNorm


class LatentNorm(RMSNorm):
    """The norms of the query and key/value latents: transformers builds DeepSeek-V3's with its
    RMSNorm's default eps, 1e-6, whatever the config's `rms_norm_eps` (megatron passes that)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        del eps
        super().__init__(config, hidden_size, eps=1e-6)


class DuplicatedLinear(torch.nn.Module):
    """A down-projection whole on every TP rank (Transformer Engine's `parallel_mode=
    "duplicated"`, which megatron's MLA expects; `compat/mla.py` installs this in its place).
    Under sequence parallelism each rank projects its own tokens and the weight's gradient is
    summed over TP, as a sequence-parallel norm's; megatron then gathers the RoPE key over the
    sequence (its backward sums every rank's heads' share). megatron's other choice,
    ColumnParallelLinear, gathers the outputs over TP and takes back only this rank's slice of
    the gradient, dropping the other ranks' heads' share of the RoPE key's."""

    def __init__(
        self, input_size: int, output_size: int, *, config: TransformerConfig, **unused: Any
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype)
        )
        # finalize_model_grads all-reduces grads of params tagged this way over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None
