"""Tiny random-weight Hugging Face models and batches for the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from torch.overrides import TorchFunctionMode

from policyworker.data.batched_data_dict import BatchedDataDict

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    # mixture of experts: 8 experts, top-2
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
}
MOE = {
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
        norm_topk_prob=True, mlp_only_layers=[0],
    ),
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    # sigmoid routing with the expert bias, 2 groups (1 chosen), scaled; a shared expert; a
    # dense first layer; q/k/v biases, q/k norms, RoPE on half of each head
    "glm4_moe": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        norm_topk_prob=True, head_dim=32, attention_bias=True, use_qk_norm=True,
    ),
    # multi-head latent attention (q and kv latents, interleaved RoPE rows) and GLM-4.5's routing
    # with 4 groups (2 chosen)
    "deepseek_v3": dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
    ),
    # sinks, biases everywhere, the clamped SwiGLU, YaRN; layers 0 and 2 slide over 5 tokens,
    # 1 and 3 see every earlier token
    "gpt_oss": dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
        sliding_window=5, num_hidden_layers=4,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=32),
    ),
    # three Gated DeltaNet layers, then gated full attention (q/k norms, RoPE on a quarter of
    # each head); 2 key heads repeated to 4 value heads; zero-centered norms
    "qwen3_5": dict(
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4,
        architectures=["Qwen3_5ForCausalLM"],
    ),
}  # fmt: skip
MOE["qwen3_5_moe"] = {  # Qwen3.5's layers with Qwen2-MoE's experts in every layer
    **{k: v for k, v in MOE["qwen3_5"].items() if k != "architectures"},
    **{k: v for k, v in MOE["qwen2_moe"].items() if k != "norm_topk_prob"},
    "architectures": ["Qwen3_5MoeForCausalLM"],
}
MOE["qwen3_next"] = {  # the same, in-projections fused per key head; a dense first layer
    **{k: v for k, v in MOE["qwen3_5_moe"].items() if k != "architectures"},
    "norm_topk_prob": True, "mlp_only_layers": [0], "architectures": ["Qwen3NextForCausalLM"],
}  # fmt: skip


def make_hf_model(folder: Path, arch: str = "llama", *, seed: int = 0, **overrides: object) -> Path:
    """Save a random tiny model of `arch`; norms and biases are perturbed so they matter."""
    kw: dict[str, object] = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )
    if arch == "qwen3":
        kw["head_dim"] = 32
    kw.update(MOE.get(arch, {}))
    if arch == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    cfg_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or name.endswith(".sinks"):
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith("experts.gate_up_proj") and arch == "gpt_oss":
                p.mul_(60.0)  # some gate/up values past the SwiGLU's clamp at 7
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a router's expert bias (a buffer)
                b.add_(torch.randn_like(b) * 0.2)
    model.save_pretrained(folder)
    return folder


def make_batch(
    *,
    batch: int = 4,
    seq: int = 12,
    vocab: int = 101,
    seed: int = 0,
    lengths: list[int] | None = None,
    topk: int = 4,
) -> BatchedDataDict:
    """Right-padded random batch with mixed lengths and the full contract of every loss: GRPO's
    fields, `rewards` [B], and a random teacher's `teacher_topk_logits/indices` [B, S, topk]."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g).tolist()
        lengths[0] = seq
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    pos = torch.arange(seq)[None, :]
    valid = pos < torch.tensor(lengths)[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    token_mask = (valid & (pos >= 3)).float()
    adv = torch.randn(batch, 1, generator=g).expand(batch, seq).clone()
    prev = -torch.rand(batch, seq, generator=g) * 3
    teacher_ids = torch.stack(
        [torch.randperm(vocab, generator=g)[:topk] for _ in range(batch * seq)]
    )
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor(lengths),
        token_mask=token_mask,
        sample_mask=torch.ones(batch),
        advantages=adv,
        prev_logprobs=prev,
        generation_logprobs=prev + 0.05 * torch.randn(batch, seq, generator=g),
        reference_policy_logprobs=prev + 0.1 * torch.randn(batch, seq, generator=g),
        rewards=(torch.rand(batch, generator=g) > 0.5).float(),
        teacher_topk_logits=3 * torch.randn(batch, seq, topk, generator=g),
        teacher_topk_indices=teacher_ids.reshape(batch, seq, topk),
    )


def hf_attention(folder: Path) -> str:
    """transformers' attention for the model in `folder`: SDPA, or eager (gpt-oss has no SDPA)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    return "eager" if config.model_type == "gpt_oss" else "sdpa"


def hf_logprobs(
    folder: Path,
    data: BatchedDataDict,
    *,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> torch.Tensor:
    """Reference logprobs from transformers (SDPA; eager where a family has no SDPA path:
    gpt-oss), same alignment as the worker's; on CPU."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=hf_attention(folder)
    )
    model = model.to(device).eval()
    ids = data["input_ids"].to(device)
    lengths = data["input_lengths"].to(device)
    mask = (torch.arange(ids.shape[1], device=device)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    return (out * mask).cpu()


def clean_env() -> dict[str, str]:
    """This process's environment for a child that starts its own torch.distributed (torchrun
    or a single process): no rank variables of ours, one OpenMP thread."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def in_interpreter(script: str, *args: object) -> list[str]:
    """Run `tests/<script>` in a process of its own under Triton's interpreter (Triton reads
    TRITON_INTERPRET when a kernel is defined); its stdout lines. A failed run fails the test
    with the end of its stderr."""
    here = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, str(here / script), *map(str, args)],
        env={**clean_env(), "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=here,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def torchrun(script: Path, *args: object, nproc: int = 2, timeout_s: float = 600) -> None:
    """`script` under `torchrun --standalone` on `nproc` CPU ranks (`clean_env`); a failed launch
    fails the test with the end of its stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values back to the host (`tolist`, `item`, `int()`, `bool()`, ...)
    made inside the forward of any transformer layer of `model` (or module of `kind`) — each one a
    device sync on GPU. Use as a context manager around the calls."""

    READS = frozenset({"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu"})

    def __init__(self, model: torch.nn.Module, kind: type | None = None) -> None:
        from megatron.core.transformer.transformer_layer import TransformerLayer

        super().__init__()
        self.depth, self.reads = 0, []
        for module in model.modules():
            if isinstance(module, kind or TransformerLayer):
                module.register_forward_pre_hook(lambda *_: self._enter(1))
                module.register_forward_hook(lambda *_: self._enter(-1))

    def _enter(self, step: int) -> None:
        self.depth += step

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if self.depth and name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))
