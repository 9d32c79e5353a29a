"""Mixture-of-experts training and logprobs beside transformers, and grouped experts beside
megatron's SequentialMLP, in one process on one GPU.

The model is Qwen3-MoE-shaped, random, bf16 (defaults: 10 layers, hidden 2048, 32 query / 4 KV
heads of 128, 48 experts of intermediate 768, top-8 renormalized, vocabulary 151936, untied:
3.08B parameters; 0.88B matmul parameters active per token, the output layer's 0.31B included):

* ours:        `MegatronPolicyWorker.train(NLLLoss)` / `get_logprobs`, experts on grouped GEMMs
               (`moe.moe_grouped_gemm`, the default);
* ours-seq:    the same worker with megatron's SequentialMLP experts (a GEMM pair per expert);
* hf:          `Qwen3MoeForCausalLM` (attn_implementation="sdpa", experts_implementation=
               "grouped_mm"), forward with labels, backward, fused AdamW on the bf16 parameters; its
               "logprobs" a no-grad forward, log_softmax and gather.

MFU counts the active parameters' matmuls (6 · active matmul params · tokens) and causal
attention (6 · L · s · h per token) against 790 TFLOP/s. Prints one JSON line.

    python benchmarks/moe_bench.py [--layers 10] [--experts 48] [--topk 8] [--steps 5]
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
    profile_table,
    save_random,
    timed,
)


def moe_config(args: argparse.Namespace):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.expert_ffn,  # dense layers (none here)
        moe_intermediate_size=args.expert_ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )


def random_moe(args: argparse.Namespace) -> tuple[Path, object, int]:
    from transformers import Qwen3MoeForCausalLM

    return save_random(Qwen3MoeForCausalLM, moe_config(args), "bench-moe-")


def active_flops(cfg, tokens: int, seq: int) -> tuple[float, int]:
    """(flops of a train step on the active parameters, active matmul parameters)."""
    h, L, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = h * q + 2 * h * kv + q * h
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    active = L * (attention + experts + h * cfg.num_experts) + v * h
    return 6 * active * tokens + 6 * L * seq * q * tokens, active


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
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.bfloat16,
        attn_implementation="sdpa",
        experts_implementation="grouped_mm" if DEVICE == "cuda" else "eager",
    ).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=DEVICE == "cuda")

    def train_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def logprob_step() -> None:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])

    out = {"train_s": timed(train_step, steps), "logprobs_s": timed(logprob_step, steps)}
    if prof:
        profile_table("transformers train step", train_step)
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("layers", 10), ("hidden", 2048), ("heads", 32), ("kv-heads", 4), ("head-dim", 128),
        ("experts", 48), ("topk", 8), ("expert-ffn", 768), ("vocab", 151936),
        ("seq", 2048), ("batch", 4), ("steps", 5),
    ):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None, help="also write the JSON line here")
    ap.add_argument("--profile", action="store_true", help="op tables of a train step (stderr)")
    args = ap.parse_args()
    folder, cfg, n_params = random_moe(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=DEVICE)
    flops, active = active_flops(cfg, args.batch * args.seq, args.seq)
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
