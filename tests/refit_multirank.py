"""An IPC refit from a TP2 or PP2 trainer (two gloo ranks) into one generation process, then one
with every matrix prequantized to MXFP8 into another, for tests/test_refit.py. Rank 0 hosts the
receivers and sends; rank 1 only takes part in the gathers. Each layout in turn, in one launch.

    python -m torch.distributed.run --nproc_per_node 2 tests/refit_multirank.py MODEL OUTDIR \
        NAME:TP:PP ...        (rank 0 writes OUTDIR/NAME.pt)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from multirank import between_runs

from policyworker.config import ParallelConfig, PolicyConfig
from policyworker.generation.process import GenerationProcess
from policyworker.worker import MegatronPolicyWorker


def run_layout(model: str, out: Path, tp: int, pp: int) -> None:
    cfg = PolicyConfig(
        model_name=model,
        precision="float32",
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
    )
    worker = MegatronPolicyWorker(cfg)
    info = worker.prepare_refit_info()
    sender = dist.get_rank() == 0
    gen = GenerationProcess(model, info) if sender else None
    if gen is not None:
        gen.begin_refit_ipc(worker.get_zmq_address())
    report = worker.stream_weights_via_ipc_zmq(buffer_size_bytes=8192, send=sender)
    result = {}
    if gen is not None:
        version = gen.end_refit()
        result = {"info": info, "weights": gen.weights(), "version": version, "report": report}
        gen.close()
    # then MXFP8: every matrix prequantized (quantized after the TP gather / PP broadcast)
    names = [n for n, (shape, _) in info.items() if len(shape) == 2 and shape[-1] % 32 == 0]
    mx_info = worker.enable_refit_prequantize(names)
    gen = GenerationProcess(model, mx_info) if sender else None
    if gen is not None:
        gen.begin_refit_ipc(worker.get_zmq_address())
    worker.stream_weights_via_ipc_zmq(buffer_size_bytes=8192, send=sender)
    if gen is not None:
        gen.end_refit()
        torch.save({**result, "mxfp8_names": names, "mxfp8_weights": gen.weights()}, out)
        gen.close()
    worker.shutdown()


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    for spec in sys.argv[3:]:
        name, tp, pp = spec.split(":")
        run_layout(model, out / f"{name}.pt", int(tp), int(pp))
        between_runs()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
