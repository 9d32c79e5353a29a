"""Hybrid linear attention (Qwen3.5): training and logprobs beside transformers, and the gated
delta rule's kernel beside transformers' reference implementation, in one process on one GPU.

The model is random, bf16, Qwen3.5-shaped: `--layers` (three Gated DeltaNet layers to each
gated full-attention layer), hidden 2048, full attention 16 query / 4 KV heads of 256 (RoPE on
a quarter), linear attention 16 key heads repeated to 32 value heads of 128, conv kernel 4,
MLP 6144, vocabulary 151936, untied.

* ours:      `MegatronPolicyWorker.train(NLLLoss)` / `get_logprobs`, one sequence per
             micro-batch (packed), the rule by `model/paths.choose_paths` (flash-linear-
             attention's kernels when fla-core is installed, else our PyTorch chunked form:
             the JSON line says which: `ours_rule`);
* hf:        the transformers model (attn_implementation="sdpa"), forward with labels,
             backward, fused AdamW; its "logprobs" a no-grad forward, log_softmax and gather.
             transformers itself takes flash-linear-attention's kernels when they import
             (`hf_rule`), else its PyTorch reference;
* long:      ours alone at `--long` tokens with full activation recompute and chunked logits;
* kernel:    the rule alone, forward + backward, at `--kernel-tokens` tokens of one sequence:
             ours (as chosen) against transformers' `torch_chunk_gated_delta_rule`.

Each measurement that runs out of memory is recorded as "oom". Prints one JSON line (tokens/s,
peak memory, ratios).

    python benchmarks/hybrid_bench.py [--lengths 4096,32768] [--long 65536] [--steps 3]
    python benchmarks/hybrid_bench.py --layers 4 --hidden 64 --ffn 96 --vocab 128 \\
        --lengths 64 --long 128 --kernel-tokens 128 --steps 1 --small   # CPU smoke
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from train_bench import DEVICE, emit, free, full_rows, hf_steps, save_random, timed

OOM = (torch.OutOfMemoryError,)


def qwen3_5_config(args: argparse.Namespace) -> Any:
    import transformers

    heads = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128)  # fmt: skip
    if args.small:  # a CPU smoke run's heads
        heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=8)  # fmt: skip
    return transformers.Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        max_position_embeddings=max([args.long, *args.lengths]), architectures=["Qwen3_5ForCausalLM"],
        **heads,
    )  # fmt: skip


def worker(folder: Path, tokens: int, *, long: bool) -> Any:
    from policyworker.config import PolicyConfig, RecomputeConfig, SequencePackingConfig
    from policyworker.worker import MegatronPolicyWorker

    cfg = PolicyConfig(
        model_name=str(folder),
        precision="bfloat16",
        train_global_batch_size=1,
        train_micro_batch_size=1,
        logprob_batch_size=1,
        max_total_sequence_length=tokens,
        logprob_chunk_size=4096 if long else None,
        recompute=RecomputeConfig(activation_checkpointing=long),
        sequence_packing=SequencePackingConfig(
            enabled=True, train_mb_tokens=tokens, logprob_mb_tokens=tokens
        ),
    )
    return MegatronPolicyWorker(cfg, init_reference_model=False)


def measured(run: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """`run`'s figures and its peak memory, or {"oom": True}."""
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        out: dict[str, Any] = run()
    except OOM:
        out = {"oom": True}
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    free()
    return out


def bench_ours(folder: Path, tokens: int, steps: int, *, long: bool = False) -> dict[str, Any]:
    from policyworker.losses import NLLLoss

    ids = torch.randint(0, 100, (1, tokens))
    data = full_rows(ids)

    def run() -> dict[str, float]:
        w = worker(folder, tokens, long=long)
        try:
            out = {"train_s": timed(lambda: w.train(data, NLLLoss()), steps, warmup=1)}
            out["logprobs_s"] = timed(lambda: w.get_logprobs(data=data), steps, warmup=1)
        finally:
            w.shutdown()
        return out

    return measured(run)


def bench_hf(folder: Path, tokens: int, steps: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 100, (1, tokens), device=DEVICE)

    def run() -> dict[str, float]:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).to(DEVICE)
        train_step, logprob_step = hf_steps(model, ids)
        return {
            "train_s": timed(train_step, steps, warmup=1),
            "logprobs_s": timed(logprob_step, steps, warmup=1),
        }

    return measured(run)


def bench_kernel(cfg: Any, tokens: int, steps: int) -> dict[str, Any]:
    """The rule alone, forward + backward over one sequence of `tokens` (bf16 inputs)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from policyworker.model.paths import choose_paths

    rule = choose_paths(
        torch.device(DEVICE), torch.bfloat16, batch_invariant=False, decode_attention="sdpa"
    ).mixing.now.rule
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    g0 = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g0, device=DEVICE, dtype=torch.bfloat16)
        return t.requires_grad_()

    q, k, v = rand(1, tokens, h, dk), rand(1, tokens, h, dk), rand(1, tokens, h, dv)
    g = (-torch.rand(1, tokens, h, device=DEVICE, generator=g0) * 0.5).requires_grad_()
    beta = torch.rand(1, tokens, h, device=DEVICE, generator=g0, dtype=torch.bfloat16)
    beta.requires_grad_()

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: fn().float().square().mean().backward()

    ours = measured(lambda: {"s": timed(step(lambda: rule(q, k, v, g, beta, None)), steps)})
    ref = measured(
        lambda: {
            "s": timed(
                step(
                    lambda: torch_chunk_gated_delta_rule(
                        q, k, v, g, beta, use_qk_l2norm_in_kernel=True
                    )[0]
                ),
                steps,
            )
        }
    )
    return {"tokens": tokens, "ours": ours, "transformers_reference": ref}


def ratio(hf: dict[str, Any], ours: dict[str, Any], key: str) -> float | None:
    if key not in hf or key not in ours:
        return None
    return hf[key] / ours[key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 8), ("hidden", 2048), ("ffn", 6144), ("vocab", 151936),
                          ("long", 65536), ("kernel_tokens", 32768), ("steps", 3)):  # fmt: skip
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    ap.add_argument(
        "--lengths", default="4096,32768", help="tokens of one sequence, comma-separated"
    )
    ap.add_argument("--small", action="store_true", help="tiny heads (a CPU smoke run)")
    ap.add_argument("--out", default=None, help="also write the JSON line here")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    import transformers

    from policyworker.ops.gated_delta import fla_installed

    cfg = qwen3_5_config(args)
    folder, _, n_params = save_random(transformers.Qwen3_5ForCausalLM, cfg, "bench-qwen3-5-")
    rows: dict[str, Any] = {}
    for tokens in args.lengths:
        ours, hf = bench_ours(folder, tokens, args.steps), bench_hf(folder, tokens, args.steps)
        rows[str(tokens)] = {
            "ours": ours,
            "hf": hf,
            "ours_tokens_per_s": tokens / ours["train_s"] if "train_s" in ours else None,
            "train_speedup_vs_hf": ratio(hf, ours, "train_s"),
            "logprobs_speedup_vs_hf": ratio(hf, ours, "logprobs_s"),
        }
    long = bench_ours(folder, args.long, 1, long=True)
    fla = DEVICE == "cuda" and fla_installed()
    row = {
        "bench": "hybrid_train_and_logprobs",
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "shape": vars(args) | {"params": n_params},
        "ours_rule": "fla" if fla else "torch",
        "hf_rule": "fla" if fla_installed() else "torch",
        "by_tokens": rows,
        "long_recompute": {"tokens": args.long, **long},
        "kernel": bench_kernel(cfg, args.kernel_tokens, args.steps),
    }
    emit(row, args.out)


if __name__ == "__main__":
    main()
