"""Packing on a realistic RL batch: padded, token-budget and packed micro-batches side by side.

One ~1.6B Llama-like model (the one of `train_bench.py`), bf16, one GPU, one process, one worker
whose micro-batch plan is swapped between runs. The batch: 64 sequences, prompts of 128-512
tokens, responses log-normal with median 700 tokens, capped at 8192 (the loss covers the
responses). Each plan trains one global batch (NLLLoss) and scores it (get_logprobs):

* padded_to_longest: a fixed number of rows per micro-batch (`--padded-rows`, 4), every one
            padded to the batch's longest row (a worker that does not trim micro-batches);
* padded:   the same rows per micro-batch, each micro-batch trimmed to its own longest row (our
            default without a budget);
* budgeted: dynamic batching, rows sorted by length, cut at the token budget;
* packed:   sequence packing into bins of the token budget (flash varlen attention);
* no-waste: the limit — full micro-batches of equal-length sequences (no padding at all) with the
            same token budget and about as many tokens as the RL batch.

Prints one JSON line: real (unpadded) tokens per second of each, the ratios, peak memory.

    python benchmarks/packing_bench.py [--budget 16384] [--steps 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import DEVICE, emit, free, full_rows, hf_config, temporary_folder, timed


def rl_batch(
    n: int, vocab: int, seed: int, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [n, S], lengths [n], token_mask [n, S]) of prompt + response rows."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(128, 513, (n,), generator=g)
    responses = torch.exp(math.log(700) + 0.9 * torch.randn(n, generator=g)).long().clamp(1, cap)
    lengths = prompts + responses
    width = int(lengths.max())
    ids = torch.randint(0, vocab, (n, width), generator=g)
    pos = torch.arange(width)[None, :]
    mask = ((pos >= prompts[:, None]) & (pos < lengths[:, None])).float()
    return ids, lengths, mask


def pad_to_longest_plan() -> object:
    """Fixed-size micro-batches that keep the batch's full width (no trimming)."""
    from policyworker.data.microbatch import FixedSize, Microbatch

    class PadToLongest(FixedSize):
        def split(self, batch, *, train, mbs, rows_per_example=1):  # type: ignore[no-untyped-def]
            starts = range(0, batch.size, mbs)
            return [
                Microbatch(rows=list(range(s, s + mbs)), data=batch.slice(s, s + mbs))
                for s in starts
            ]

    return PadToLongest()


def run(worker: object, data: object, steps: int) -> dict[str, float]:
    from policyworker.losses import NLLLoss

    torch.cuda.reset_peak_memory_stats() if DEVICE == "cuda" else None
    out = {
        "train_s": timed(lambda: worker.train(data, NLLLoss()), steps, warmup=1),
        "logprobs_s": timed(lambda: worker.get_logprobs(data=data), steps, warmup=1),
    }
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    return out


def use_plan(worker: Any, plan: Any, *, mbs: int, gbs: int | None = None) -> None:
    """Run a built worker with the bench's plan and sizes (its trainer and scorer hold their
    own references to the plan and the default sizes)."""
    worker.plan = worker.trainer.plan = plan
    worker.scorer = dataclasses.replace(worker.scorer, plan=plan, default_mbs=mbs)
    settings = worker.trainer.settings
    worker.trainer.settings = dataclasses.replace(settings, mbs=mbs, gbs=gbs or settings.gbs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch")
    parser.add_argument("--cap", type=int, default=8192, help="longest response")
    parser.add_argument("--padded-rows", type=int, default=4, help="rows per padded micro-batch")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()

    from transformers import LlamaForCausalLM

    from policyworker.config import PolicyConfig
    from policyworker.data.batched_data_dict import BatchedDataDict
    from policyworker.data.microbatch import FixedSize, Packed, TokenBudget
    from policyworker.worker import MegatronPolicyWorker

    cfg = hf_config(args.layers, args.hidden, args.vocab)
    cfg.max_position_embeddings = 512 + args.cap
    folder = temporary_folder("bench-pack-")  # removed at exit
    torch.manual_seed(0)
    with torch.device(DEVICE):
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    free()

    ids, lengths, mask = rl_batch(args.batch, args.vocab, 0, args.cap)
    b, width = ids.shape
    real_tokens = int(lengths.sum())
    rows_padded = args.padded_rows
    worker = MegatronPolicyWorker(
        PolicyConfig(
            model_name=str(folder),
            precision="bfloat16",
            train_global_batch_size=b,
            train_micro_batch_size=1,
            logprob_batch_size=1,
            max_total_sequence_length=max(width, 2048),
        ),
        init_reference_model=False,
    )
    data = BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=mask, sample_mask=torch.ones(b)
    )
    plans = {
        "padded_to_longest": pad_to_longest_plan(),
        "padded": FixedSize(),
        "budgeted": TokenBudget(train_tokens=args.budget, logprob_tokens=args.budget),
        "packed": Packed(
            algorithm="modified_first_fit_decreasing",
            train_tokens=args.budget,
            logprob_tokens=args.budget,
            divisible_by=1,
        ),
    }
    results = {}
    for name, plan in plans.items():
        use_plan(worker, plan, mbs=rows_padded)
        results[name] = run(worker, data, args.steps)
        free()
    # No waste: equal 2048-token rows, budget / 2048 per micro-batch, about as many tokens.
    seq = 2048
    n_full = max(args.budget // seq, 1) * max(1, round(real_tokens / args.budget))
    full = full_rows(torch.randint(0, args.vocab, (n_full, seq)))
    use_plan(worker, FixedSize(), mbs=args.budget // seq, gbs=n_full)
    results["no_waste"] = run(worker, full, args.steps)
    tokens = {name: real_tokens for name in plans}
    tokens["no_waste"] = n_full * seq

    row: dict[str, object] = {
        "bench": "packing",
        "sequences": b,
        "real_tokens": real_tokens,
        "longest": int(lengths.max()),
        "median_length": int(lengths.median()),
        "budget": args.budget,
        "padded_rows_per_microbatch": rows_padded,
    }
    for name, r in results.items():
        row[f"{name}_train_tok_s"] = tokens[name] / r["train_s"]
        row[f"{name}_logprobs_tok_s"] = tokens[name] / r["logprobs_s"]
        row[f"{name}_peak_mem_gib"] = r["peak_mem_gib"]
    for kind in ("train", "logprobs"):
        packed = row[f"packed_{kind}_tok_s"]
        row[f"packed_vs_padded_{kind}"] = packed / row[f"padded_{kind}_tok_s"]
        row[f"packed_vs_no_waste_{kind}"] = packed / row[f"no_waste_{kind}_tok_s"]
        row[f"packed_vs_padded_to_longest_{kind}"] = packed / row[f"padded_to_longest_{kind}_tok_s"]
        row[f"budgeted_vs_padded_{kind}"] = (
            row[f"budgeted_{kind}_tok_s"] / row[f"padded_{kind}_tok_s"]
        )
    emit(row, args.out)


if __name__ == "__main__":
    main()
