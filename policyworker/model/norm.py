"""RMSNorm with Hugging Face's arithmetic, usable by megatron's layer specs.

megatron's local spec wraps `torch.nn.RMSNorm`, which rejects sequence parallelism and rounds
differently from transformers in bf16. This one computes in fp32 and casts back before the weight,
exactly as `LlamaRMSNorm` does, and tags its weight for megatron's sequence-parallel grad reduce.
On GPU the same arithmetic runs as one fused kernel (torch.compile): unfused, the fp32 temporaries
of ~2 norms per layer cost about a tenth of a training step.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.ops.compiled import cuda_compiled


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x^2) + eps))` in fp32, cast back to x's dtype before the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """Normalizes over the last dimension; built as `(config, hidden_size, eps)`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # finalize_model_grads all-reduces grads of params tagged this way over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
