"""Long sequences on one GPU: training and scoring one sequence of 4k-64k tokens per micro-batch.

The ~1.6B Llama-like model of `train_bench.py`, bf16, one process, side by side:

* ours, plain:          `MegatronPolicyWorker.train(NLLLoss)`, packed, one sequence per bin;
* ours, chunk:          with `logprob_chunk_size` (the logits in chunks of `--chunk` tokens);
* ours, block+chunk:    chunked, with full recompute of the first `--block-layers` layers only
                        (`recompute_method: block`; the others keep their activations);
* ours, recompute:      plain with full activation recompute of every layer;
* ours, recompute+chunk: both;
* hf:                   `LlamaForCausalLM` (sdpa), fused AdamW, with gradient checkpointing
                        (in train mode: transformers checkpoints only then) and without, at the
                        lengths each fits;
* scoring:              `get_logprobs` of one sequence by a worker without and one with
                        `logprob_chunk_size` (logits and, without gradient, the MLP in chunks),
                        up to `--score-lengths`;
* CP attention kernel:  one CP=2 rank's attention blocks, flash varlen against one masked SDPA
                        per block, forward + backward, at `--cp-lengths` (GPU only).

Each variant runs its lengths in increasing order until one runs out of memory (recorded as
"oom"). Prints one JSON line: per variant and length, tokens/s, MFU (model FLOPs, causal
attention counted, recompute not), peak memory; at each length transformers fits, the ratio of
each of our variants' tokens/s to transformers with gradient checkpointing.

    python benchmarks/long_context_bench.py [--lengths 4096,8192,16384,32768,65536]
        [--score-lengths 32768,65536,131072] [--cp-lengths 8192,16384,32768] [--chunk 4096]
        [--steps 2] [--variants plain,chunk,...] [--hf-variants grad_ckpt,plain]

An empty list (`--lengths ""`) skips that part: e.g. the scoring alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from policyworker.config import RecomputeConfig

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import (
    DEVICE,
    PEAK_BF16_FLOPS,
    emit,
    flops_per_step,
    free,
    full_rows,
    random_model,
    timed,
)

VARIANTS = {  # name -> (full recompute: none, of every layer, of the first few; chunk the logits)
    "plain": (None, False),
    "chunk": (None, True),
    "block_chunk": ("block", True),
    "recompute": ("uniform", False),
    "recompute_chunk": ("uniform", True),
}


def measure(step: Callable[[], Any], steps: int) -> dict[str, float] | str:
    """Seconds per step (median), peak memory and the peak above what was resident before (the
    step's own: activations, logits, gradients), or "oom"."""
    free()
    resident = 0
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    try:
        seconds = timed(step, steps, warmup=2)
    except torch.OutOfMemoryError:
        free()
        return "oom"
    peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
    return {"s": seconds, "peak_gib": peak / 2**30, "step_gib": (peak - resident) / 2**30}


def worker_for(
    folder: Path,
    longest: int,
    recompute: RecomputeConfig | None,
    chunk: int | None,
    *,
    train: bool = True,
) -> Any:
    from policyworker.config import PolicyConfig, SequencePackingConfig
    from policyworker.worker import MegatronPolicyWorker

    cfg = PolicyConfig(
        model_name=str(folder),
        precision="bfloat16",
        train_global_batch_size=1,
        train_micro_batch_size=1,
        logprob_batch_size=1,
        max_total_sequence_length=longest,
        logprob_chunk_size=chunk,
        recompute=recompute or RecomputeConfig(),
        sequence_packing=SequencePackingConfig(
            enabled=True, train_mb_tokens=longest, logprob_mb_tokens=longest
        ),
    )
    return MegatronPolicyWorker(cfg, init_optimizer=train, init_reference_model=False)


def bench_ours(folder: Path, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from policyworker.losses import NLLLoss

    out: dict[str, Any] = {}
    if not args.lengths:
        return out
    longest = max(args.lengths)
    for name in args.variants:
        method, chunked = VARIANTS[name]
        recompute = None
        if method is not None:
            layers = args.block_layers if method == "block" else 1
            recompute = RecomputeConfig(
                activation_checkpointing=True, recompute_method=method, recompute_num_layers=layers
            )
        worker = worker_for(folder, longest, recompute, args.chunk if chunked else None)
        rows: dict[str, Any] = {}
        for length in args.lengths:
            data = full_rows(torch.randint(0, cfg.vocab_size, (1, length)))
            got = measure(lambda d=data, w=worker: w.train(d, NLLLoss()), args.steps)
            rows[str(length)] = with_rates(got, cfg, length)
            progress(name, length, rows[str(length)])
            if got == "oom":
                break
        out[name] = rows
        worker.shutdown()
        del worker  # before the next variant's worker is built
        free()
    return out


def bench_scoring(folder: Path, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """get_logprobs of one sequence, by a worker without `logprob_chunk_size` and one with; and
    how far apart their logprobs of the shortest sequence are (chunks change matmul shapes)."""
    out: dict[str, Any] = {}
    if not args.score_lengths:
        return out
    first: dict[str, torch.Tensor] = {}
    for name, chunk in (("unchunked", None), ("chunked", args.chunk)):
        worker = worker_for(folder, max(args.score_lengths), None, chunk, train=False)
        rows: dict[str, Any] = {}
        for length in args.score_lengths:
            g = torch.Generator().manual_seed(length)  # both workers score the same tokens
            data = full_rows(torch.randint(0, cfg.vocab_size, (1, length), generator=g))
            got = measure(lambda d=data, w=worker: w.get_logprobs(data=d), args.steps)
            rows[str(length)] = got if got == "oom" else {**got, "tok_s": length / got["s"]}
            progress(f"scoring {name}", length, rows[str(length)])
            if got == "oom":
                break
            first.setdefault(name, worker.get_logprobs(data=data)["logprobs"].float())
        out[name] = rows
        worker.shutdown()
        del worker
        free()
    if len(first) == 2:
        out["max_abs_diff_at_shortest"] = (first["chunked"] - first["unchunked"]).abs().max().item()
    return out


def bench_hf(folder: Path, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name in args.hf_variants:
        ckpt = HF_VARIANTS[name]
        out[name] = hf_rows(folder, cfg, args, ckpt)
        free()
    return out


HF_VARIANTS = {"grad_ckpt": True, "plain": False}


def hf_rows(folder: Path, cfg: Any, args: argparse.Namespace, ckpt: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(DEVICE)
    model.config.use_cache = False
    model.train()  # from_pretrained leaves eval mode, where transformers does not checkpoint
    if ckpt:
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=DEVICE == "cuda")
    rows: dict[str, Any] = {}
    for length in args.lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, length), device=DEVICE)

        def step(ids: torch.Tensor = ids) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        got = measure(step, args.steps)
        rows[str(length)] = with_rates(got, cfg, length)
        progress(f"hf ckpt={ckpt}", length, rows[str(length)])
        if got == "oom":
            break
    return rows  # the model and optimizer go with this frame (the caller frees the cache)


def bench_cp_kernel(args: argparse.Namespace) -> dict[str, Any]:
    """Context-parallel attention of one CP=2 rank (two query blocks of a sequence against its
    gathered keys), forward + backward, flash varlen against one masked SDPA per block — the
    kernel alone, which one GPU can run (CP itself needs two)."""
    return {str(n): cp_kernel_row(n, args.steps) for n in args.cp_lengths}


def cp_kernel_row(length: int, steps: int) -> dict[str, Any]:
    from policyworker.model.attention.kernels import (
        context_blocks_cuda,
        context_blocks_reference,
    )
    from policyworker.parallel.context import ContextSplit

    heads, kv_heads, dim = 32, 8, 64  # the attention of train_bench's model
    split = ContextSplit(rank=0, size=2, group=None, padded=(length,))  # type: ignore[arg-type]
    plan = split.plan(torch.device(DEVICE))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (
        torch.randn(n, h, dim, generator=g, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
        for n, h in ((length // 2, heads), (length, kv_heads), (length, kv_heads))
    )
    row: dict[str, Any] = {}
    for name, kernel in (("flash", context_blocks_cuda), ("masked", context_blocks_reference)):
        row[name] = measure(lambda f=kernel: f(q, k, v, plan, dim**-0.5).sum().backward(), steps)
    if isinstance(row["flash"], dict) and isinstance(row["masked"], dict):
        row["speedup"] = row["masked"]["s"] / row["flash"]["s"]
    return row


def progress(name: str, length: int, row: object) -> None:
    """Each measurement to stderr as it is made (a run cut short still shows what it did)."""
    print(f"{name} {length}: {row}", file=sys.stderr, flush=True)


def with_rates(got: dict[str, float] | str, cfg: Any, length: int) -> dict[str, float] | str:
    if got == "oom":
        return got
    assert isinstance(got, dict)
    mfu = flops_per_step(cfg, length, length) / got["s"] / PEAK_BF16_FLOPS
    return {**got, "tok_s": length / got["s"], "mfu": mfu}


def main() -> None:
    parser = argparse.ArgumentParser()
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731 ("": skip that part)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--lengths", type=ints, default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--score-lengths", type=ints, default=[32768, 65536, 131072])
    parser.add_argument("--cp-lengths", type=ints, default=[8192, 16384, 32768])
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument(
        "--block-layers", type=int, default=11, help="block+chunk: layers recomputed"
    )
    names = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--variants", type=names, default=list(VARIANTS))
    parser.add_argument("--hf-variants", type=names, default=list(HF_VARIANTS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()

    cp_kernel = bench_cp_kernel(args) if DEVICE == "cuda" else {}
    folder, cfg, n_params = random_model(args.layers, args.hidden, args.vocab)
    ours = bench_ours(folder, cfg, args)
    scoring = bench_scoring(folder, cfg, args)
    hf = {} if args.skip_hf or not args.lengths else bench_hf(folder, cfg, args)
    free()
    speedup = {
        name: {
            n: hf["grad_ckpt"][n]["s"] / rows[n]["s"]
            for n in hf.get("grad_ckpt", {})
            if isinstance(hf["grad_ckpt"][n], dict) and isinstance(rows.get(n), dict)
        }
        for name, rows in ours.items()
    }
    fits = [
        n
        for n, r in scoring.get("unchunked", {}).items()
        if isinstance(r, dict) and n in scoring["chunked"]
    ]
    plain_at = scoring["unchunked"][fits[-1]] if fits else None
    chunked_at = scoring["chunked"].get(fits[-1]) if fits else None
    row = {
        "bench": "long_context",
        "params": n_params,
        "chunk": args.chunk,
        "ours": ours,
        "hf": hf,
        "scoring": scoring,
        "cp_attention_kernel": cp_kernel,
        "train_speedup_vs_hf_grad_ckpt": speedup,
        # the scoring call's own memory, chunked / unchunked, at the longest unchunked fits
        "scoring_step_mem_ratio": (
            chunked_at["step_gib"] / plain_at["step_gib"]
            if isinstance(chunked_at, dict) and isinstance(plain_at, dict) and plain_at["step_gib"]
            else None
        ),
    }
    emit(row, args.out)


if __name__ == "__main__":
    main()
