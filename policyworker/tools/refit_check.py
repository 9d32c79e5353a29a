"""`python -m policyworker refit-check --model DIR`: does a refit deliver exactly the trainer's
weights? Starts a trainer (a `Policy` of `--trainer-tp` ranks) and a receiver — a
`GenerationProcess` (ipc, collective) or destination workers of `--receiver-tp` ranks (reshard) —
refits, scores a fixed batch on both sides, prints one JSON line and exits non-zero on any
mismatch. `--transport sparse`: a training step before each refit (a sparse refit sends what
changed), into an engine that loaded the same HF weights; the line adds `changed_fraction` and
`wire_bytes`.

The receiver's weights must equal the trainer's export bit for bit (a generation process compares
per-tensor sums computed where it holds them; destination workers export theirs), and the two
sides' logprobs must agree within the precision's tolerance.
"""

from __future__ import annotations

import json
import math
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from policyworker.driver.policy import Policy
    from policyworker.refit.layout import RefitReport

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}  # transformers vs megatron-core logprobs
TRANSPORTS = ("ipc", "collective", "reshard", "sparse")


@dataclass(frozen=True, slots=True)
class CheckOptions:
    model: str
    transport: str = "ipc"
    precision: str = "float32"
    buffer_size_bytes: int = 0
    timeout_s: float = 60.0
    refits: int = 2
    trainer_tp: int = 1
    """The trainer's tensor parallel size; its ranks: the least multiple of TP and EP x ETP."""
    receiver_tp: int = 1
    """The destination workers' tensor parallel size (reshard only; ranks as the trainer's)."""
    trainer_ep: int = 1
    """The trainer's expert parallel size (an MoE model)."""
    receiver_ep: int = 1
    """The destination workers' expert parallel size (reshard only)."""
    trainer_etp: int = 1
    """The trainer's expert tensor parallel size (an MoE model)."""
    receiver_etp: int = 1
    """The destination workers' expert tensor parallel size (reshard only)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport: expected one of {TRANSPORTS}, got {self.transport!r}")
        sizes = ("tp", "ep", "etp")
        for name in (*(f"{side}_{s}" for side in ("trainer", "receiver") for s in sizes), "refits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("receiver_tp", "receiver_ep", "receiver_etp"):
            if getattr(self, name) != 1 and self.transport != "reshard":
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}: only the reshard transport has destination workers")


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """What a receiving side (`_engine`, `_sparse`, `_reshard`) is given: the options, the
    batch both sides score, a scratch folder, and the extra fields of the JSON line it fills."""

    opts: CheckOptions
    ids: torch.Tensor
    lengths: torch.Tensor
    tmp: Path
    extra: dict[str, object]
    key: str | None = None
    """The run's key for signed sparse refits (the trainers hold it as `KEY_ENV`)."""


def _ranks(tp: int, ep: int, etp: int) -> int:
    return math.lcm(tp, ep * etp)


def _config(opts: CheckOptions, tp: int, ep: int, etp: int) -> Any:
    from policyworker.config import ParallelConfig, PolicyConfig, RefitConfig

    return PolicyConfig(
        model_name=opts.model,
        precision=opts.precision,
        max_total_sequence_length=64,
        refit=RefitConfig(timeout_s=opts.timeout_s, checksum=True),
        # sequence parallel with TP: what an MoE model needs, and the same weights for any
        parallel=ParallelConfig(
            tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        ),
    )


def run_check(opts: CheckOptions) -> dict[str, object]:
    """The refit check; returns the JSON row (`ok` False on any mismatch)."""
    from policyworker.data.batched_data_dict import BatchedDataDict
    from policyworker.driver.policy import Policy
    from policyworker.refit.sparse import KEY_ENV, fresh_key_env

    sizes = (opts.trainer_tp, opts.trainer_ep, opts.trainer_etp)
    cfg = _config(opts, *sizes)
    trains = opts.transport == "sparse"  # a sparse refit sends what training changed
    extra: dict[str, object] = {}
    env = fresh_key_env() if trains else {}  # the run's key: sparse messages are signed
    with (
        Policy(
            cfg, _ranks(*sizes), init_optimizer=trains, init_reference_model=False, env=env
        ) as trainer,
        tempfile.TemporaryDirectory() as tmp,
    ):
        ids, lengths = _fixed_batch(trainer.shape.vocab_size)
        side = {"reshard": _reshard, "sparse": _sparse}.get(opts.transport, _engine)
        run = Run(
            opts=opts, ids=ids, lengths=lengths, tmp=Path(tmp), extra=extra, key=env.get(KEY_ENV)
        )
        report, version, equal, theirs = side(trainer, run)
        ours = trainer.get_logprobs(data=BatchedDataDict(input_ids=ids, input_lengths=lengths))
    diff = float((ours["logprobs"] - theirs).abs().max())
    return extra | {
        "transport": opts.transport,
        "trainer_tp": opts.trainer_tp,
        "receiver_tp": opts.receiver_tp,
        "trainer_ep": opts.trainer_ep,
        "receiver_ep": opts.receiver_ep,
        "trainer_etp": opts.trainer_etp,
        "receiver_etp": opts.receiver_etp,
        "bytes": report.bytes,
        "seconds": report.seconds,
        "gbps": report.gbps,
        "weight_version": version,
        "trainer_weight_version": report.version,
        "names": report.names,
        "weights_equal": equal,
        "max_logprob_diff": diff,
        "ok": equal and version == report.version and diff <= TOLERANCE[opts.precision],
    }


def _exported(policy: Policy, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    policy.save_hf_pretrained(folder)
    return load_file(folder / "model.safetensors")


def _engine(trainer: Policy, run: Run) -> tuple[RefitReport, int, bool, torch.Tensor]:
    """Refits into a generation process over IPC or the collective."""
    opts, ids, lengths, tmp = run.opts, run.ids, run.lengths, run.tmp
    from policyworker.driver.policy import rank_flags
    from policyworker.generation import process
    from policyworker.parallel.dims import free_port

    info, size = trainer.prepare_refit_info(), opts.buffer_size_bytes
    with process.GenerationProcess(
        opts.model, info, device=str(trainer.device), load_weights=False
    ) as gen:
        if opts.transport == "collective":
            port = free_port()
            gen.init_collective("127.0.0.1", port, 2, 1)
            trainer.init_collective("127.0.0.1", port, 2)
        for _ in range(opts.refits):
            if opts.transport == "collective":
                gen.begin_refit_collective(opts.timeout_s)
                report = trainer.broadcast_weights_for_collective(buffer_size_bytes=size or None)
            else:
                gen.begin_refit_ipc(trainer.get_zmq_address()[0], opts.timeout_s)
                send = rank_flags(trainer.world_size, [0])
                report = trainer.stream_weights_via_ipc_zmq(buffer_size_bytes=size, send=send)[0]
            version = gen.end_refit()
        return report, version, _same_weights(gen, trainer, tmp), gen.logprobs(ids, lengths)


def _same_weights(gen: Any, trainer: Policy, tmp: Path) -> bool:
    """The engine's weights equal the trainer's export bit for bit (per-tensor sums)."""
    from policyworker.generation.process import tensor_sums

    sums, want = gen.weight_sums(), _exported(trainer, tmp / "trainer")
    return sums.keys() == want.keys() and all(sums[n] == tensor_sums(t) for n, t in want.items())


def _sparse(trainer: Policy, run: Run) -> tuple[RefitReport, int, bool, torch.Tensor]:
    """A training step, then a sparse refit over TCP into a generation process that loaded the
    same HF weights (every trainer rank a producer), `opts.refits` times."""
    opts, ids, lengths, tmp, extra = run.opts, run.ids, run.lengths, run.tmp, run.extra
    import time

    from policyworker.data.batched_data_dict import BatchedDataDict
    from policyworker.generation.process import GenerationProcess
    from policyworker.losses import NLLLoss
    from policyworker.refit.layout import RefitReport
    from policyworker.refit.sparse import KEY_ENV

    world = trainer.world_size
    shards = dict(shard_rank=list(range(world)), shard_count=world)
    info = trainer.init_remote_sparse_delta_baseline(**shards, transport="zmq")
    batch = BatchedDataDict(
        input_ids=ids, input_lengths=lengths,
        token_mask=(torch.arange(ids.shape[1])[None, :] < lengths[:, None]).float(),
        sample_mask=torch.ones(ids.shape[0]),
    )  # fmt: skip
    with GenerationProcess(opts.model, info, device=str(trainer.device)) as gen:
        target = gen.bind_sparse(api_key=run.key)
        for k in range(opts.refits):
            trainer.train(batch, NLLLoss(), gbs=ids.shape[0], mbs=1)
            gen.begin_refit_sparse(f"check-{k}", world, opts.timeout_s)
            start = time.perf_counter()
            stats = trainer.stream_remote_sparse_weights(
                "zmq", [target], transfer_id=f"check-{k}", api_key_env_var=KEY_ENV,
                timeout_s=opts.timeout_s, overwrite_names=[], **shards,
            )  # fmt: skip
            version = gen.end_refit()
            seconds = time.perf_counter() - start
            trainer.finish_remote_sparse_delta_sync(succeeded=True)
        total = {key: sum(s[key] for s in stats) for key in stats[0]}
        report = RefitReport(version=version, bytes=total["wire_bytes"], seconds=seconds,
                             names=len(info), buckets=total["payloads"], checksum=True)  # fmt: skip
        extra |= {"wire_bytes": total["wire_bytes"],
                  "changed_fraction": total["changed_elements"] / total["total_elements"]}  # fmt: skip
        return report, version, _same_weights(gen, trainer, tmp), gen.logprobs(ids, lengths)


def _reshard(trainer: Policy, run: Run) -> tuple[RefitReport, int, bool, torch.Tensor]:
    """Refits into destination workers of another TP / EP / expert-TP layout."""
    opts, ids, lengths, tmp = run.opts, run.ids, run.lengths, run.tmp
    from policyworker.data.batched_data_dict import BatchedDataDict
    from policyworker.driver.policy import Policy
    from policyworker.parallel.dims import free_port

    sizes = (opts.receiver_tp, opts.receiver_ep, opts.receiver_etp)
    d = _ranks(*sizes)
    with Policy(_config(opts, *sizes), d, is_refit_destination=True) as dest:
        port, s = free_port(), trainer.world_size
        both(
            lambda: trainer.init_reshard("127.0.0.1", port, s, d, opts.timeout_s),
            lambda: dest.init_reshard("127.0.0.1", port, s, d, opts.timeout_s),
        )
        for _ in range(opts.refits):
            report, version = both(trainer.nccl_reshard_refit, dest.nccl_reshard_refit)
        want, have = _exported(trainer, tmp / "trainer"), _exported(dest, tmp / "destination")
        equal = want.keys() == have.keys() and all(torch.equal(want[n], have[n]) for n in want)
        theirs = dest.get_logprobs(data=BatchedDataDict(input_ids=ids, input_lengths=lengths))
        return report, version, equal, theirs["logprobs"]


def both_sides(first: Any, second: Any) -> tuple[Any, Any]:
    """`first()` in a thread and `second()` here, at once (the two sides of one collective);
    each one's result, or the exception it raised."""
    out: dict[int, Any] = {}

    def run(i: int, fn: Any) -> None:
        try:
            out[i] = fn()
        except BaseException as e:
            out[i] = e

    thread = threading.Thread(target=run, args=(0, first))
    thread.start()
    run(1, second)
    thread.join()
    return out[0], out[1]


def both(first: Any, second: Any) -> tuple[Any, Any]:
    """`both_sides`, raising the first exception either side raised."""
    results = both_sides(first, second)
    for value in results:
        if isinstance(value, BaseException):
            raise value
    return results


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
