"""Mixture-of-experts training and logprobs beside transformers, and grouped experts beside
megatron's SequentialMLP, in one process on one GPU.

The model is random, bf16, of `--arch`: Qwen3-MoE-shaped by default (10 layers, hidden 2048, 32
query / 4 KV heads of 128, 48 experts of intermediate 768, top-8 renormalized, vocabulary 151936,
untied: 3.08B parameters; 0.88B matmul parameters active per token, the output layer's 0.31B
included); `deepseek_v3` (2.2B: latent attention, 64 routed experts in 8 groups, 4 chosen, top-6,
1 shared, a dense first layer), `glm4_moe` (GLM-4.5-Air-shaped, partial RoPE) and `gpt_oss`
(gpt-oss-20b-shaped at 2.1B: sinks, sliding windows, biases; transformers runs it eagerly, having
no SDPA path for it): ARCH_DEFAULTS.

* ours:        `MegatronPolicyWorker.train(NLLLoss)` / `get_logprobs`, experts on grouped GEMMs
               (`moe.moe_grouped_gemm`, the default);
* ours-seq:    the same worker with megatron's SequentialMLP experts (a GEMM pair per expert);
* hf:          the transformers model (attn_implementation="sdpa", experts_implementation=
               "grouped_mm"), forward with labels, backward, fused AdamW on the bf16 parameters; its
               "logprobs" a no-grad forward, log_softmax and gather.

MFU counts the active parameters' matmuls (6 · active matmul params · tokens) and causal
attention (3 · L · s · heads · (key + value head width) per token) against 790 TFLOP/s. Prints one JSON line.

    python benchmarks/moe_bench.py [--arch qwen3_moe] [--layers 10] [--experts 48] [--steps 5]
    python benchmarks/moe_bench.py --arch deepseek_v3 --steps 4       # fits an 80 GB card
    python benchmarks/moe_bench.py --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 \\
        --experts 8 --topk 2 --expert-ffn 32 --vocab 128 --seq 32 --batch 2 --steps 1   # CPU smoke
    add --profile for an op table of one train step of ours and of transformers, the device's
    busy time against the step's, and the host's Python functions by own time (stderr)

The default shape needs the H200's memory (the three models run in turn in one process); on an
80 GB card `--layers 6` (2.10B parameters) fits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from train_bench import (
    DEVICE,
    PEAK_BF16_FLOPS,
    emit,
    free,
    full_rows,
    hf_steps,
    profile_table,
    save_random,
    timed,
)

# Each architecture's defaults for the shape arguments (None on the command line: these).
ARCH_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3_moe": dict(
        layers=10, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=48, topk=8,
        expert_ffn=768, vocab=151936,
    ),
    # DeepSeek-V3's layout at 2.2B: latent attention (q latent 768, kv latent 512, a 64-wide
    # rope head beside the 128-wide one), 64 routed experts in 8 groups (4 chosen) + 1 shared,
    # top-6, sigmoid scores with the expert bias, a dense first layer
    "deepseek_v3": dict(
        layers=6, hidden=2048, heads=16, kv_heads=16, head_dim=128, experts=64, topk=6,
        expert_ffn=768, vocab=129280,
    ),
    # GLM-4.5-Air's layout at 2.2B: RoPE on half of each head, 1 shared expert, top-8 sigmoid
    "glm4_moe": dict(
        layers=6, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=64, topk=8,
        expert_ffn=768, vocab=151552,
    ),
    # gpt-oss-20b's layout at 2.1B: 64 query / 8 KV heads of 64, sinks, sliding-window (128)
    # and full layers alternating, biases, the clamped SwiGLU, 32 experts top-4, YaRN
    "gpt_oss": dict(
        layers=6, hidden=2048, heads=64, kv_heads=8, head_dim=64, experts=32, topk=4,
        expert_ffn=1024, vocab=201088,
    ),
}  # fmt: skip


def moe_config(args: argparse.Namespace):
    """The transformers config of `args.arch` with the shape arguments."""
    import transformers

    if args.arch == "gpt_oss":
        return transformers.GptOssConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim, num_local_experts=args.experts,
            num_experts_per_tok=args.topk, intermediate_size=args.expert_ffn,
            max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False,
        )  # fmt: skip
    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_experts_per_tok=args.topk,
        moe_intermediate_size=args.expert_ffn,
        intermediate_size=4 * args.expert_ffn,  # the dense layers'
        norm_topk_prob=True,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )
    if args.arch == "qwen3_moe":
        extra = dict(head_dim=args.head_dim, num_experts=args.experts, mlp_only_layers=[])
        return transformers.Qwen3MoeConfig(**common, **extra, decoder_sparse_step=1)
    deepseek_routing = dict(
        n_routed_experts=args.experts, n_shared_experts=1, first_k_dense_replace=1
    )
    if args.arch == "glm4_moe":
        extra = dict(head_dim=args.head_dim, partial_rotary_factor=0.5, n_group=1, topk_group=1)
        return transformers.Glm4MoeConfig(**common, **deepseek_routing, **extra)
    groups = max(1, min(8, args.experts // 8))  # 8 groups of 8 at 64 experts, 4 chosen
    latent = dict(
        q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=args.head_dim,
        qk_rope_head_dim=args.head_dim // 2, v_head_dim=args.head_dim, n_group=groups,
        topk_group=max(1, groups // 2), routed_scaling_factor=2.5, rope_scaling=None,
    )  # fmt: skip
    return transformers.DeepseekV3Config(**common, **deepseek_routing, **latent)


def random_moe(args: argparse.Namespace) -> tuple[Path, object, int]:
    import transformers

    names = {"qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe",
             "gpt_oss": "GptOss"}  # fmt: skip
    model_cls = getattr(transformers, f"{names[args.arch]}ForCausalLM")
    return save_random(model_cls, moe_config(args), f"bench-{args.arch.replace('_', '-')}-")


def active_flops(folder: Path, cfg, tokens: int, seq: int) -> tuple[float, int]:
    """(flops of a train step on the active parameters, active matmul parameters), read off
    the saved checkpoint's tensors: every matrix but the embedding (and gpt-oss's stacked
    biases), an expert's at top-k / experts; and causal attention, 3 · s · heads · (key + value
    head width) per token and layer, a sliding-window layer's at its share of the keys."""
    from safetensors import safe_open

    experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    active = 0.0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = f.get_slice(name).get_shape()
                if len(shape) < 2 or "embed_tokens" in name or name.endswith("_bias"):
                    continue
                n = float(torch.Size(shape).numel())
                active += n * cfg.num_experts_per_tok / experts if ".experts." in name else n
    key_width = getattr(cfg, "qk_head_dim", None) or cfg.head_dim
    value_width = getattr(cfg, "v_head_dim", None) or cfg.head_dim
    heads, window = cfg.num_attention_heads, getattr(cfg, "sliding_window", None) or seq
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    # a query's mean count of keys, over s / 2 (a full layer's)
    share = min(1.0, window * (1 - window / (2 * seq)) / (seq / 2))
    layers = sum(share if kind == "sliding_attention" else 1.0 for kind in kinds)
    attention = 3 * layers * seq * heads * (key_width + value_width) * tokens
    return 6 * active * tokens + attention, int(active)


def bench_ours(
    folder: Path, ids: torch.Tensor, steps: int, grouped: bool, prof: bool = False
) -> dict[str, float]:
    from policyworker.config import MoEConfig, PolicyConfig
    from policyworker.losses import NLLLoss
    from policyworker.worker import MegatronPolicyWorker

    b, s = ids.shape
    cfg = PolicyConfig(
        model_name=str(folder),
        precision="bfloat16",
        train_global_batch_size=b,
        train_micro_batch_size=b,
        logprob_batch_size=b,
        max_total_sequence_length=s,
        moe=MoEConfig(moe_grouped_gemm=grouped),
    )
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    worker = MegatronPolicyWorker(cfg, init_reference_model=False)
    data = full_rows(ids)
    out = {"train_s": timed(lambda: worker.train(data, NLLLoss()), steps)}
    if grouped:
        out["logprobs_s"] = timed(lambda: worker.get_logprobs(data=data), steps)
    if prof:
        profile_table("ours train step", lambda: worker.train(data, NLLLoss()))
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    worker.shutdown()
    return out


def bench_hf(folder: Path, ids: torch.Tensor, steps: int, prof: bool = False) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    eager = "gpt-oss" in folder.name  # transformers' gpt-oss has no SDPA path
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.bfloat16,
        attn_implementation="eager" if eager else "sdpa",
        experts_implementation="grouped_mm" if DEVICE == "cuda" else "eager",
    ).to(DEVICE)
    train_step, logprob_step = hf_steps(model, ids)
    out = {"train_s": timed(train_step, steps), "logprobs_s": timed(logprob_step, steps)}
    if prof:
        profile_table("transformers train step", train_step)
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCH_DEFAULTS), default="qwen3_moe")
    for name in ARCH_DEFAULTS["qwen3_moe"]:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    for name, default in (("seq", 2048), ("batch", 4), ("steps", 5)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None, help="also write the JSON line here")
    ap.add_argument("--profile", action="store_true", help="op tables of a train step (stderr)")
    args = ap.parse_args()
    for name, default in ARCH_DEFAULTS[args.arch].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    folder, cfg, n_params = random_moe(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=DEVICE)
    flops, active = active_flops(folder, cfg, args.batch * args.seq, args.seq)
    ours = bench_ours(folder, ids, args.steps, grouped=True, prof=args.profile)
    free()
    sequential = bench_ours(folder, ids, args.steps, grouped=False)
    free()
    hf = bench_hf(folder, ids, args.steps, prof=args.profile)
    row = {
        "bench": "moe_train_and_logprobs",
        "device": DEVICE,
        "shape": vars(args) | {"params": n_params, "active_matmul_params": active},
        "ours": ours,
        "ours_sequential_mlp": sequential,
        "hf": hf,
        "train_speedup_vs_hf": hf["train_s"] / ours["train_s"],
        "grouped_vs_sequential_train": sequential["train_s"] / ours["train_s"],
        "logprobs_speedup_vs_hf": hf["logprobs_s"] / ours["logprobs_s"],
        "ours_mfu": flops / ours["train_s"] / PEAK_BF16_FLOPS,
        "hf_mfu": flops / hf["train_s"] / PEAK_BF16_FLOPS,
    }
    emit(row, args.out)


if __name__ == "__main__":
    main()
