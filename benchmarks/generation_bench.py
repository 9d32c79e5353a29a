"""Generation throughput: the worker's own `generate` beside two transformers baselines.

The ~1.6B Llama-like random model of `train_bench.py`, bf16, one process, one GPU; every row
has a `--prompt`-token prompt and draws exactly `--new` tokens (no stop token: random weights
would stop at random), sampling at temperature 1:

* ours:       `MegatronPolicyWorker.generate` (our decode loop, KV cache in the core attention);
* ours_triton: the same with `generation.decode_attention: triton` (our decode kernel);
* ours_invariant: the same with `batch_invariant: true` (generation logprobs bitwise scoring's);
* engine:     our transformers engine (`generation.engine.HFEngine.draw`, what
              `GenerationProcess` runs: transformers' `generate` with its dynamic cache);
* hf_static:  transformers' `generate` with `cache_implementation="static"`.

For ours it also scores the generated rows with `get_logprobs` and reports the
`token_mult_prob_error` of the generation logprobs (mean over response tokens of
exp|generation − get_logprobs|, and its largest per-token value) and the scoring's time; `--mismatch-sources` also
scores the same rows with fp32 `get_logprobs` (each bf16 side against it, and bf16
`get_logprobs` at two micro-batch sizes) and checks which of the model's GEMMs give the same
bits for a few rows as inside a large product. Prints one JSON line with tokens/s per engine and
batch size and the ratios. CPU: a smoke run with `--smoke`.

    python benchmarks/generation_bench.py [--batches 64,256] [--prompt 512] [--new 1024]
        [--engines ours,ours_triton,ours_invariant,engine,hf_static] [--profile]
        [--mismatch-sources]
    python benchmarks/generation_bench.py --arch deepseek_v3 --engines ours,engine,hf_static
        (moe_bench's 2.2B DeepSeek-V3-shaped model; its latent attention decodes with SDPA)
    python benchmarks/generation_bench.py --arch qwen3_5 --engines ours,engine
        (hybrid_bench's Qwen3.5-shaped model: its linear layers' conv windows and states cached)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_bench import ARCH_DEFAULTS, random_moe
from train_bench import DEVICE, emit, free, profile_table, random_model, save_random, sync


def seconds(run: Callable[[], object]) -> tuple[float, object]:
    sync()
    start = time.perf_counter()
    out = run()
    sync()
    return time.perf_counter() - start, out


def our_worker(
    folder: Path,
    precision: str,
    rows: int,
    width: int,
    kernel: str = "sdpa",
    invariant: bool = False,
):
    from policyworker.config import PolicyConfig
    from policyworker.worker import MegatronPolicyWorker

    cfg = PolicyConfig(
        model_name=str(folder),
        precision=precision,
        logprob_batch_size=min(rows, 16),
        max_total_sequence_length=width,
        batch_invariant=invariant,
        generation={"max_new_tokens": 1, "stop_token_ids": [], "decode_attention": kernel},
    )
    return MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)


def mult_prob_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of exp|a - b| (NeMo-RL's `token_mult_prob_error`)."""
    return float((a - b).abs().exp().mean())


def mismatch_sources(
    worker, folder: Path, seqs: object, gen: torch.Tensor, scored: torch.Tensor, p: int
) -> dict:
    """Where the generation's bf16 mismatch comes from: the generation (`gen`) and bf16
    `get_logprobs` (`scored`, the worker's micro-batches) each against fp32 `get_logprobs` of the
    same sequences, bf16 `get_logprobs` at two micro-batch sizes, and the first / last 64
    response tokens (`--mismatch-sources`); shuts the worker down."""
    scored_mb2 = worker.get_logprobs(data=seqs, micro_batch_size=2)["logprobs"][:, p:]
    b, width = seqs["input_ids"].shape
    worker.shutdown()
    free()
    fp32 = our_worker(folder, "float32", b, width)
    ref = fp32.get_logprobs(data=seqs, micro_batch_size=4)["logprobs"][:, p:]
    fp32.shutdown()
    return {
        "generation_vs_fp32": mult_prob_error(gen, ref),
        "get_logprobs_vs_fp32": mult_prob_error(scored, ref),
        "get_logprobs_mb16_vs_mb2": mult_prob_error(scored, scored_mb2),
        "first64_generation_vs_get_logprobs": mult_prob_error(gen[:, :64], scored[:, :64]),
        "last64_generation_vs_get_logprobs": mult_prob_error(gen[:, -64:], scored[:, -64:]),
    }


def gemm_invariance(cfg: object, rows: tuple[int, ...] = (1, 64, 256)) -> dict[str, list]:
    """For each projection of the model (K -> N): the fraction of the outputs of an M-row bf16
    `linear` that differ from the same rows inside a 6144-row product, per M in `rows`: where a
    decode step's GEMMs reproduce the training forward's bits."""
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    out = {}
    for name, k, n in (("qkv", h, h + 2 * kv), ("o", h, h), ("gate_up", h, 2 * inter),
                       ("down", inter, h), ("lm_head", h, v)):  # fmt: skip
        w = torch.randn(n, k, device=DEVICE, generator=g).bfloat16() * 0.02
        x = torch.randn(6144, k, device=DEVICE, generator=g).bfloat16()
        whole = torch.nn.functional.linear(x, w)
        out[f"{name}_{k}x{n}"] = [
            float((torch.nn.functional.linear(x[:m], w) != whole[:m]).float().mean()) for m in rows
        ]
        del w, x, whole
    return out


def bench_ours(
    folder: Path,
    prompts: torch.Tensor,
    new: int,
    precision: str,
    kernel: str = "sdpa",
    prof: bool = False,
    sources: bool = False,
    invariant: bool = False,
) -> dict[str, float]:
    from policyworker.data.batched_data_dict import BatchedDataDict

    b, p = prompts.shape
    worker = our_worker(folder, precision, b, p + new, kernel, invariant)
    settings = worker.sampler.settings  # the sampler's own (the worker's config is fixed)
    data = BatchedDataDict({"input_ids": prompts, "input_lengths": torch.full((b,), p)})
    settings.max_new_tokens = 8  # a short warm-up call
    worker.generate(data=data, seed=1)
    if prof:  # a 32-token call: prefill and 31 decode steps
        settings.max_new_tokens = 32
        profile_table(f"generate, 32 new tokens, {kernel}", lambda: worker.generate(data=data))
    settings.max_new_tokens = new
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    took, out = seconds(lambda: worker.generate(data=data, seed=0))
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    after = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    assert int(out["generation_lengths"].min()) == new
    seqs = {"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]}
    seqs = BatchedDataDict(seqs)
    gen = out["logprobs"][:, p:]
    worker.get_logprobs(data=seqs)  # compiles and plans for these shapes
    score_s, scored = seconds(lambda: worker.get_logprobs(data=seqs)["logprobs"][:, p:])
    error = (gen - scored).abs().exp()
    row = {
        "s": took,
        "tokens_per_s": b * new / took,
        "peak_mem_gib": peak,
        "kv_cache_residue_bytes": after - before if DEVICE == "cuda" else 0,
        "token_mult_prob_error": float(error.mean()),
        "token_mult_prob_error_max": float(error.max()),
        "get_logprobs_s": score_s,
    }
    if sources:
        row |= mismatch_sources(worker, folder, seqs, gen, scored, p)
    return row


def bench_engine(folder: Path, prompts: torch.Tensor, new: int, dtype: torch.dtype) -> dict:
    from policyworker.generation.engine import HFEngine

    engine = HFEngine(str(folder), None, device=torch.device(DEVICE), dtype=dtype)
    engine.model.generation_config.eos_token_id = None
    rows = prompts.tolist()

    def run(n: int) -> object:
        return engine.draw(rows, pad_id=0, eos_id=None, max_new_tokens=n, temperature=1.0, seed=0)

    run(8)
    took, (drawn, _) = seconds(lambda: run(new))
    assert drawn.shape[1] == new
    return {"s": took, "tokens_per_s": prompts.shape[0] * new / took}


def bench_hf_static(folder: Path, prompts: torch.Tensor, new: int, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model = model.to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    ids = prompts.to(DEVICE)

    def run(n: int) -> torch.Tensor:
        torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                cache_implementation="static",
            )

    run(8)
    took, out = seconds(lambda: run(new))
    assert out.shape[1] == ids.shape[1] + new
    return {"s": took, "tokens_per_s": prompts.shape[0] * new / took}


def random_hybrid(positions: int, *, small: bool) -> tuple[Path, object, int]:
    """hybrid_bench's Qwen3.5-shaped model (a tiny one for `--smoke`)."""
    import transformers
    from hybrid_bench import qwen3_5_config

    size = dict(layers=4, hidden=64, ffn=96, vocab=1000) if small else {}
    shape = dict(layers=8, hidden=2048, ffn=6144, vocab=151936) | size
    cfg = qwen3_5_config(argparse.Namespace(**shape, long=positions, lengths=[], small=small))
    return save_random(transformers.Qwen3_5ForCausalLM, cfg, "bench-qwen3-5-")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--arch", default="llama", choices=["llama", "deepseek_v3", "glm4_moe", "qwen3_5"],
        help="llama: the dense model of train_bench; qwen3_5: hybrid_bench's; else moe_bench's "
        "model of that arch",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--engines", default="ours,ours_triton,ours_invariant,engine,hf_static")
    parser.add_argument("--smoke", action="store_true", help="a tiny fp32 run (CPU)")
    parser.add_argument("--profile", action="store_true", help="op tables of ours (stderr)")
    parser.add_argument(
        "--mismatch-sources",
        action="store_true",
        help="also score ours against fp32 get_logprobs, and test the GEMMs' batch invariance",
    )
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.vocab = 2, 256, 1000
        args.batches, args.prompt, args.new = "2,4", 16, 8
    precision = "bfloat16" if DEVICE == "cuda" else "float32"
    dtype = getattr(torch, precision)
    if args.arch == "llama":
        folder, cfg, n_params = random_model(args.layers, args.hidden, args.vocab)
    elif args.arch == "qwen3_5":  # hybrid_bench's shape (--layers/--hidden/--vocab ignored)
        folder, cfg, n_params = random_hybrid(args.prompt + args.new, small=args.smoke)
    else:  # moe_bench's shape of that arch (--layers/--hidden/--vocab ignored)
        shape = ARCH_DEFAULTS[args.arch] | {"seq": args.prompt + args.new, "arch": args.arch}
        if args.smoke:
            shape |= dict(layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, experts=8, topk=2)
            shape |= dict(expert_ffn=32, vocab=1000)
        folder, cfg, n_params = random_moe(argparse.Namespace(**shape))
    engines = args.engines.split(",")
    runs = {
        "ours": functools.partial(bench_ours, prof=args.profile, sources=args.mismatch_sources),
        "ours_triton": functools.partial(
            bench_ours, kernel="triton", prof=args.profile, sources=args.mismatch_sources
        ),
        "ours_invariant": functools.partial(
            bench_ours, kernel="triton", invariant=True, prof=args.profile
        ),
        "engine": bench_engine,
        "hf_static": bench_hf_static,
    }
    shape = {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    shape |= {"arch": args.arch, "prompt": args.prompt, "new": args.new}
    row: dict[str, object] = {"bench": "generation", "device": DEVICE, "shape": shape}
    row["params"] = n_params
    if args.mismatch_sources:
        row["gemm_rows_differing"] = gemm_invariance(cfg)
    for batch in (int(b) for b in args.batches.split(",")):
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, cfg.vocab_size, (batch, args.prompt), generator=g)
        results = {}
        for name in engines:
            kind = precision if name.startswith("ours") else dtype
            results[name] = runs[name](folder, prompts, args.new, kind)
            free()  # the engine's model went with its function
            print(f"batch {batch} {name}: {results[name]}", file=sys.stderr, flush=True)
        for ours in [n for n in engines if n.startswith("ours")]:
            for other in [n for n in engines if not n.startswith("ours")]:
                ratio = results[ours]["tokens_per_s"] / results[other]["tokens_per_s"]
                results[f"{ours}_vs_{other}"] = ratio
        row[f"batch_{batch}"] = results
    emit(row, args.out)


if __name__ == "__main__":
    main()
