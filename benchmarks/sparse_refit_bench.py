"""Remote sparse-delta refit on real updates: bytes on the wire against a full refit.

A bf16 Llama (fp32 master weights) takes optimizer steps at the reference's typical learning
rates (NLL on random tokens; Adam makes each element's update about lr whatever the gradient);
after each step one sparse refit goes over loopback TCP into generation processes.

* baseline: a full refit, the model's bytes (to one engine: the ratio is conservative); the
            trainer's export alone;
* ours:     `stream_remote_sparse_weights` (the bytes leaving the trainer, once however many
            engines: they relay; changed fraction; the trainer's export + compare + encode; end
            to end into `--receivers` engines, each applying whole versions); every engine's
            weights checked bitwise against the trainer's export.

Prints one JSON line per (model, lr, receivers).

    python benchmarks/sparse_refit_bench.py [--sizes 1b] [--lrs 1e-6,3e-6] [--steps 3]
        [--receivers 2]   (a list, e.g. 1,2,4: one run each)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from train_bench import DEVICE, emit, free, full_rows, random_model, sync

SIZES = {  # layers, hidden, vocab (intermediate 4 x hidden, GQA 32/8 heads; see train_bench)
    "1b": (16, 2048, 128256),
    "small": (4, 1024, 32000),  # 0.1B: loopback timings on a CPU
    "tiny": (2, 256, 1000),  # a CPU smoke run of the script
}


def trainer_seconds(worker, baseline: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(export alone, export + compare + encode) seconds, and the encoded bytes."""
    from policyworker.refit.sparse_codec import delta, encode

    sync()
    t = time.perf_counter()
    for _ in worker.export_hf_weights():
        pass
    sync()
    export = time.perf_counter() - t
    t = time.perf_counter()
    deltas = [delta(n, x, baseline[n]) for n, x in worker.export_hf_weights()]
    body, _ = encode(deltas)
    sync()
    return export, time.perf_counter() - t, len(body)


def bench(size: str, lr: float, steps: int, receivers: int) -> dict[str, object]:
    from policyworker import MegatronPolicyWorker, NLLLoss, PolicyConfig
    from policyworker.config import OptimizerConfig
    from policyworker.generation.process import GenerationProcess, tensor_sums
    from policyworker.refit.sparse import KEY_ENV, fresh_key_env

    layers, hidden, vocab = SIZES[size]
    folder, _, n_params = random_model(layers, hidden, vocab)
    cfg = PolicyConfig(
        model_name=str(folder), precision="bfloat16", train_global_batch_size=4,
        train_micro_batch_size=1, max_total_sequence_length=512,
        optimizer=OptimizerConfig(lr=lr, weight_decay=0.0),
    )  # fmt: skip
    worker = MegatronPolicyWorker(cfg, init_reference_model=False)
    info = worker.init_remote_sparse_delta_baseline(shard_rank=0, shard_count=1, transport="zmq")
    full = sum(torch.Size(s).numel() * d.itemsize for s, d in info.values())
    baseline = {n: t.detach().cpu().clone() for n, t in worker.export_hf_weights()}
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list] = {k: [] for k in ("changed", "wire", "export_s", "encode_s", "e2e_s")}
    exact = True
    engines = [GenerationProcess(str(folder), info, timeout_s=600) for _ in range(receivers)]
    try:
        os.environ.update(fresh_key_env())  # the run's key: every message is signed
        targets = [e.bind_sparse(api_key=os.environ[KEY_ENV]) for e in engines]
        for step in range(steps):
            ids = torch.randint(0, vocab, (4, 512), generator=g)
            worker.train(full_rows(ids), NLLLoss())
            export_s, encode_s, _ = trainer_seconds(worker, baseline)
            for e in engines:
                e.begin_refit_sparse(f"s{step}", 1, tree=targets)
            t = time.perf_counter()
            stats = worker.stream_remote_sparse_weights(
                "zmq", targets, transfer_id=f"s{step}", api_key_env_var=KEY_ENV, timeout_s=600,
                shard_rank=0, shard_count=1, overwrite_names=[],
            )  # fmt: skip
            versions = {e.end_refit() for e in engines}
            e2e = time.perf_counter() - t
            worker.finish_remote_sparse_delta_sync(succeeded=versions == {step + 1})
            baseline = {n: t.detach().cpu().clone() for n, t in worker.export_hf_weights()}
            sums = {n: tensor_sums(t) for n, t in baseline.items()}
            exact = exact and all(e.weight_sums() == sums for e in engines)
            rows["changed"].append(stats["changed_elements"] / stats["total_elements"])
            rows["wire"].append(stats["wire_bytes"])  # leaves the trainer once (relay)
            rows["export_s"].append(export_s)
            rows["encode_s"].append(encode_s)
            rows["e2e_s"].append(e2e)
    finally:
        for e in engines:
            e.close()
    free()
    wire = statistics.median(rows["wire"])
    return {
        "bench": "sparse_refit",
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "model": size,
        "params": n_params,
        "lr": lr,
        "steps": steps,
        "changed_fraction": rows["changed"],
        "full_bytes": full,
        "trainer_wire_bytes": rows["wire"],
        "baseline_vs_ours_bytes": full / wire,
        "export_s": statistics.median(rows["export_s"]),
        "export_compare_encode_s": statistics.median(rows["encode_s"]),
        "receivers": receivers,
        "end_to_end_s": rows["e2e_s"],
        "engines_exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1b")
    parser.add_argument("--lrs", default="1e-6,3e-6")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--receivers", default="2", help="engines per run: one run per count")
    parser.add_argument("--out", default=None, help="also write the JSON lines here")
    args = parser.parse_args()
    lines = []
    for size in args.sizes.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            for receivers in (int(x) for x in args.receivers.split(",")):
                row = bench(size, lr, args.steps, receivers)
                emit(row, None)
                lines.append(row)
            if args.out:
                import json

                Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main()
