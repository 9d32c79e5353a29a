"""RMSNorm with Hugging Face's arithmetic, usable by megatron's layer specs.

megatron's local spec wraps `torch.nn.RMSNorm`, which rejects sequence parallelism and rounds
differently from transformers in bf16. This one computes in fp32 and casts back before the weight,
exactly as `LlamaRMSNorm` does (`ops.rms_norm`: torch on the CPU, one Triton kernel each way on
the GPU), and tags its weight for megatron's sequence-parallel grad reduce.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from policyworker.ops.rms_norm import rms_norm


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


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's and Qwen3-Next's norm: the weight stored as an offset from 1 (initialized to
    zeros), x normalized in fp32 times (1 + weight) in fp32, then cast (transformers'
    `Qwen3_5RMSNorm`)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(config, hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
