"""`python -m policyworker refit-check --model DIR`: does a refit deliver exactly the trainer's
weights? Starts a trainer (this process) and a receiver (a `GenerationProcess`), refits, scores a
fixed batch on both sides, prints one JSON line and exits non-zero on any mismatch.

The receiver's weights must equal the trainer's export bit for bit (compared as per-tensor sums,
computed where each side holds them), and its logprobs (transformers) must agree with the
trainer's (megatron-core) within the precision's tolerance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from policyworker.generation.process import GenerationProcess
    from policyworker.refit.ipc import RefitReport
    from policyworker.worker import MegatronPolicyWorker

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}  # transformers vs megatron-core logprobs


@dataclass(frozen=True, slots=True)
class CheckOptions:
    model: str
    transport: str = "ipc"
    precision: str = "float32"
    buffer_size_bytes: int = 0
    timeout_s: float = 60.0
    refits: int = 2


def run_check(opts: CheckOptions) -> dict[str, object]:
    """The refit check; returns the JSON row (`ok` False on any mismatch)."""
    from policyworker import MegatronPolicyWorker, PolicyConfig
    from policyworker.config import RefitConfig
    from policyworker.generation.process import GenerationProcess, tensor_sums

    if opts.transport not in ("ipc", "collective"):
        raise ValueError(f"--transport: expected ipc or collective, got {opts.transport!r}")
    cfg = PolicyConfig(
        model_name=opts.model,
        precision=opts.precision,
        max_total_sequence_length=64,
        refit=RefitConfig(timeout_s=opts.timeout_s, checksum=True),
    )
    worker = MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
    info = worker.prepare_refit_info()
    device = str(worker.device) if worker.device.type == "cpu" else f"cuda:{worker.device.index}"
    ids, lengths = _fixed_batch(worker.shape.vocab_size)
    with GenerationProcess(opts.model, info, device=device, load_weights=False) as gen:
        if opts.transport == "collective":
            from policyworker.parallel.dims import _free_port

            port = _free_port()
            gen.init_collective("127.0.0.1", port, 2, 1)
            worker.init_collective("127.0.0.1", port, 2)
        for _ in range(opts.refits):
            report = _refit(worker, gen, opts)
            version = gen.end_refit()
        sums = gen.weight_sums()
        equal = all(sums[n] == tensor_sums(t) for n, t in worker.export_hf_weights())
        theirs = gen.logprobs(ids, lengths)
    from policyworker.data.batched_data_dict import BatchedDataDict

    ours = worker.get_logprobs(data=BatchedDataDict(input_ids=ids, input_lengths=lengths))
    diff = float((ours["logprobs"] - theirs).abs().max())
    assert report is not None
    return {
        "transport": opts.transport,
        "bytes": report.bytes,
        "seconds": report.seconds,
        "gbps": report.gbps,
        "weight_version": version,
        "trainer_weight_version": worker.weight_version,
        "names": report.names,
        "weights_equal": equal,
        "max_logprob_diff": diff,
        "ok": equal and version == worker.weight_version and diff <= TOLERANCE[opts.precision],
    }


def _refit(
    worker: MegatronPolicyWorker, gen: GenerationProcess, opts: CheckOptions
) -> RefitReport | None:
    """Start the receiver, then send: one refit over the chosen transport."""
    size = opts.buffer_size_bytes
    if opts.transport == "collective":
        gen.begin_refit_collective(opts.timeout_s)
        return worker.broadcast_weights_for_collective(buffer_size_bytes=size or None)
    gen.begin_refit_ipc(worker.get_zmq_address(), opts.timeout_s)
    return worker.stream_weights_via_ipc_zmq(buffer_size_bytes=size)


def _fixed_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([32, 17, 25, 9])
    ids = torch.randint(0, vocab, (4, 32), generator=g)
    ids[torch.arange(32)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def main(opts: CheckOptions) -> int:
    row = run_check(opts)
    print(json.dumps(row), flush=True)
    return 0 if row["ok"] else 1
