"""train() and get_logprobs() throughput beside (a) a plain megatron-core loop and (b) transformers.

All three run the same ~1.6B Llama-like random model in bf16, in one process, on one GPU:

* ours:      `MegatronPolicyWorker.train(NLLLoss)` / `get_logprobs`;
* mcore:     GPTModel (our layer spec, SDPA attention) forward with labels, backward, fused AdamW
             on the bf16 params (no master weights, no DDP buffers);
* hf:        `LlamaForCausalLM` (attn_implementation="sdpa") forward with labels, backward, fused
             AdamW on the bf16 params.

Prints one JSON line with seconds/step, tokens/s, MFU and the ratios. Needs a GPU.

    python benchmarks/train_bench.py [--layers 22] [--seq 2048] [--batch 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PEAK_BF16_FLOPS = 790e12  # measured on this H200 (8192^3 bf16 matmul), see BENCHMARKS.md
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a smoke run of the script


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_config(layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )


def temporary_folder(prefix: str, parent: str | None = None) -> Path:
    """A new folder in the temporary directory (or `parent`), removed at the process's exit."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def random_model(layers: int, hidden: int, vocab: int) -> tuple[Path, object, int]:
    """A random bf16 Llama saved as a Hugging Face folder: (folder, config, parameter count)."""
    from transformers import LlamaForCausalLM

    return save_random(LlamaForCausalLM, hf_config(layers, hidden, vocab), "bench-llama-")


def save_random(model_cls: type, cfg: object, prefix: str) -> tuple[Path, object, int]:
    """`model_cls(cfg)` with seed-0 random bf16 weights, saved to a temporary folder: (folder,
    config, parameter count). The folder (3-21 GB) is removed when the process exits, whether
    the benchmark succeeded or raised."""
    folder = temporary_folder(prefix)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = model_cls(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    free()
    return folder, cfg, n_params


def full_rows(ids: torch.Tensor) -> object:
    """The training batch of `ids` [B, S]: every row S tokens long, every token counted."""
    from policyworker.data.batched_data_dict import BatchedDataDict

    b, s = ids.shape
    return BatchedDataDict(
        input_ids=ids.cpu(),
        input_lengths=torch.full((b,), s),
        token_mask=torch.ones(b, s),
        sample_mask=torch.ones(b),
    )


def emit(row: dict[str, object], out: str | None) -> None:
    """Print the benchmark's JSON line (and write it to `out`)."""
    line = json.dumps(row)
    print(line)
    if out:
        Path(out).write_text(line + "\n")


def flops_per_step(cfg, tokens: int, seq: int) -> float:
    """6 * matmul params * tokens + causal attention (6 * L * s * h per token)."""
    h, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = h * cfg.num_key_value_heads // cfg.num_attention_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
    matmul_params = L * per_layer + v * h
    return 6 * matmul_params * tokens + 6 * L * seq * h * tokens


def timed(step: Callable[[], None], steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def event_ms(call: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Mean GPU milliseconds per call between two CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def profile_table(name: str, step: Callable[[], None], rows: int = 25) -> None:
    """One more `step()` under torch.profiler; its ops by own time (the device's on GPU) to
    stderr — where a step's time goes, beside the timings. On the GPU also how long the device
    was busy (the union of its kernels' spans) against the step's wall time; then one more
    `step()` under cProfile (backward included), its Python functions by own time: where the
    host spends a step the device waits for."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3
    key = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    print(f"--- profile: {name}\n{table}", file=sys.stderr, flush=True)
    if DEVICE == "cuda":
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        busy = union_ms(kernels)
        line = f"device busy {busy:.1f} ms of a {wall_ms:.1f} ms step (under the profiler)"
        print(f"--- {name}: {line}", file=sys.stderr, flush=True)
    host = cProfile.Profile()
    # the backward on this thread (on the GPU autograd runs it on a device thread of its own,
    # which cProfile would not see: DDP's hooks, custom autograd functions)
    with torch.autograd.set_multithreading_enabled(False):
        host.enable()
        step()
        sync()
        host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(rows)
    print(f"--- host (cProfile): {name}\n{text.getvalue()}", file=sys.stderr, flush=True)


def union_ms(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) spans given in microseconds, in milliseconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def hf_steps(model: Any, ids: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    """A transformers model's train step (forward with labels, backward, fused AdamW) and its
    "logprobs" step (a no-grad forward, log_softmax and gather) on `ids`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=DEVICE == "cuda")

    def train_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def logprob_step() -> None:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])

    return train_step, logprob_step


def bench_hf(folder: Path, ids: torch.Tensor, steps: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(DEVICE)
    train_step, logprob_step = hf_steps(model, ids)
    return {"train_s": timed(train_step, steps), "logprobs_s": timed(logprob_step, steps)}


def bench_mcore_plain(
    worker_cls, cfg_cls, folder: Path, ids: torch.Tensor, steps: int
) -> dict[str, float]:
    """The same GPTModel as ours, driven by hand: no DDP, no master weights, fused AdamW."""
    worker = worker_cls(
        cfg_cls(
            model_name=str(folder), precision="bfloat16", max_total_sequence_length=ids.shape[1]
        ),
        init_optimizer=False,
        init_reference_model=False,
    )
    model = worker.state.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)

    def train_step() -> None:
        loss = model(ids, pos, None, labels=ids).mean()  # [B, S] per-token CE from megatron
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"train_s": timed(train_step, steps)}


def by_call_site(prof: object, rows: int = 30) -> str:
    """The costliest ops with the Python frames that issued them (torch's table omits stacks)."""

    def cost(e: object) -> float:
        return e.self_device_time_total if DEVICE == "cuda" else e.self_cpu_time_total

    ranked = sorted(prof.key_averages(group_by_stack_n=8), key=cost, reverse=True)
    # the top rows, then every sizeable copy (layout copies are the avoidable cost)
    copies = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat")
    events = ranked[:rows] + [e for e in ranked[rows:] if e.key in copies and cost(e) > 200]
    lines = []
    for e in events:
        frames = " <- ".join(f for f in e.stack if "site-packages/torch/" not in f)
        lines.append(f"{cost(e) / 1e3:9.3f} ms  {e.count:5d}x  {e.key}  @ {frames}")
    return "\n".join(lines)


def bench_ours(
    worker_cls, cfg_cls, folder: Path, ids: torch.Tensor, steps: int, mbs: int, profile: str | None
) -> dict[str, float]:
    from policyworker.losses import NLLLoss

    b, s = ids.shape
    cfg = cfg_cls(
        model_name=str(folder),
        precision="bfloat16",
        train_global_batch_size=b,
        train_micro_batch_size=mbs,
        logprob_batch_size=b,
        max_total_sequence_length=s,
    )
    worker = worker_cls(cfg, init_reference_model=False)
    data = full_rows(ids)
    loss = NLLLoss()
    out = {
        "train_s": timed(lambda: worker.train(data, loss), steps),
        "logprobs_s": timed(lambda: worker.get_logprobs(data=data), steps),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0,
    }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        sort = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
        tables = []
        for name, step in (
            ("train", lambda: worker.train(data, loss)),
            ("get_logprobs", lambda: worker.get_logprobs(data=data)),
        ):
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            # verbose: keep Python stacks for by_call_site (torch drops them otherwise)
            verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
            with torch_profile(
                activities=activities, with_stack=True, experimental_config=verbose
            ) as prof:
                step()
                sync()
            tables.append(f"== {name}\n" + prof.key_averages().table(sort_by=sort, row_limit=40))
            tables.append(f"== {name} by call site\n" + by_call_site(prof))
        Path(profile).write_text("\n".join(tables))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mbs", type=int, default=0, help="micro-batch size for ours (0: = batch)")
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    parser.add_argument("--profile", default=None, help="write a profile of one train() step here")
    args = parser.parse_args()

    from policyworker.config import PolicyConfig
    from policyworker.worker import MegatronPolicyWorker

    folder, cfg, n_params = random_model(args.layers, args.hidden, args.vocab)

    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=DEVICE)
    tokens = args.batch * args.seq
    flops = flops_per_step(cfg, tokens, args.seq)
    ours = bench_ours(
        MegatronPolicyWorker,
        PolicyConfig,
        folder,
        ids,
        args.steps,
        args.mbs or args.batch,
        args.profile,
    )
    free()  # each bench ran in its own scope: its model is garbage now
    mcore = bench_mcore_plain(MegatronPolicyWorker, PolicyConfig, folder, ids, args.steps)
    free()
    hf = bench_hf(folder, ids, args.steps)

    def mfu(seconds: float) -> float:
        return flops / seconds / PEAK_BF16_FLOPS

    row = {
        "bench": "train_and_logprobs",
        "params": n_params,
        "batch": args.batch,
        "seq": args.seq,
        "mbs": args.mbs or args.batch,
        "ours_train_s": ours["train_s"],
        "mcore_train_s": mcore["train_s"],
        "hf_train_s": hf["train_s"],
        "ours_train_tok_s": tokens / ours["train_s"],
        "hf_train_tok_s": tokens / hf["train_s"],
        "ours_mfu": mfu(ours["train_s"]),
        "mcore_mfu": mfu(mcore["train_s"]),
        "hf_mfu": mfu(hf["train_s"]),
        "train_speedup_vs_hf": hf["train_s"] / ours["train_s"],
        "train_speedup_vs_mcore": mcore["train_s"] / ours["train_s"],
        "ours_logprobs_s": ours["logprobs_s"],
        "hf_forward_logprobs_s": hf["logprobs_s"],
        "ours_logprobs_tok_s": tokens / ours["logprobs_s"],
        "logprobs_speedup_vs_hf": hf["logprobs_s"] / ours["logprobs_s"],
        "ours_peak_mem_gib": ours["peak_mem_gib"],
    }
    emit(row, args.out)


if __name__ == "__main__":
    main()
