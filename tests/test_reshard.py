"""Reshard refit (`init_reshard` + `nccl_reshard_refit`): a trainer of one TP layout into
destination workers (`is_refit_destination=True`) of another, both driven by `Policy` (gloo)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import make_batch, make_hf_model
from safetensors.torch import load_file

from policyworker import Policy, RefitError
from policyworker.config import OptimizerConfig, ParallelConfig, PolicyConfig, RefitConfig
from policyworker.losses import NLLLoss
from policyworker.parallel.dims import free_port
from policyworker.tools.refit_check import both_sides

pytestmark = pytest.mark.processes


def config(folder: Path, tp: int, checksum: bool = False) -> PolicyConfig:
    return PolicyConfig(
        model_name=str(folder),
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=2,
        max_total_sequence_length=64,
        optimizer=OptimizerConfig(lr=1e-2),  # steps that visibly move the weights
        parallel=ParallelConfig(tensor_model_parallel_size=tp),
        refit=RefitConfig(checksum=checksum),
    )


def join(trainer: Policy, dest: Policy, timeout_s: float = 60) -> None:
    port, s, d = free_port(), trainer.world_size, dest.world_size
    a, b = both_sides(
        lambda: trainer.init_reshard("127.0.0.1", port, s, d, timeout_s),
        lambda: dest.init_reshard("127.0.0.1", port, s, d, timeout_s),
    )
    assert a is None and b is None, (a, b)


def exported(policy: Policy, folder: Path) -> dict[str, torch.Tensor]:
    policy.save_hf_pretrained(folder)
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("reshard"), "llama")


@pytest.mark.parametrize(("src_tp", "dst_tp", "checksum"), [(2, 1, False), (1, 2, True)])
def test_reshard_delivers_the_trainers_weights_exactly(
    model_dir, tmp_path, src_tp, dst_tp, checksum
):
    data = make_batch(batch=4, seq=12)
    with (
        Policy(config(model_dir, src_tp, checksum), num_workers=src_tp) as trainer,
        Policy(
            config(model_dir, dst_tp, checksum), num_workers=dst_tp, is_refit_destination=True
        ) as dest,
    ):
        join(trainer, dest)
        for version in (1, 2):
            trainer.train(data, NLLLoss())
            report, got = both_sides(trainer.nccl_reshard_refit, dest.nccl_reshard_refit)
            assert got == report.version == version, (report, got)
            assert report.names == 21 and report.checksum == checksum
            want = exported(trainer, tmp_path / f"t{version}")
            have = exported(dest, tmp_path / f"d{version}")
            assert want.keys() == have.keys()
            assert all(torch.equal(want[k], have[k]) for k in want)
            torch.testing.assert_close(
                dest.get_logprobs(data=data)["logprobs"],
                trainer.get_logprobs(data=data)["logprobs"],
                atol=1e-5,
                rtol=0,
            )


def test_reshard_refuses_a_mismatch_and_fails_on_a_dead_destination(model_dir, tmp_path):
    other = make_hf_model(tmp_path / "other", "llama", intermediate_size=128)
    data = make_batch(batch=4, seq=12)
    with Policy(config(model_dir, 1), num_workers=1) as trainer:
        with pytest.raises(ValueError, match="sources: expected"):
            trainer.init_reshard("127.0.0.1", free_port(), 2, 1)
        # another model: both sides refuse, the destination keeps its weights
        with Policy(config(other, 2), num_workers=2, is_refit_destination=True) as dest:
            join(trainer, dest)
            before = exported(dest, tmp_path / "before")
            trainer.train(data, NLLLoss())
            a, b = both_sides(trainer.nccl_reshard_refit, dest.nccl_reshard_refit)
            assert isinstance(a, RefitError) and "refit info differs" in str(a)
            assert isinstance(b, RefitError) and "refit info differs" in str(b)
            after = exported(dest, tmp_path / "after")
            assert all(torch.equal(before[k], after[k]) for k in before)
        # a destination that dies before the refit: the trainer fails within the timeout
        dest = Policy(config(model_dir, 1), num_workers=1, is_refit_destination=True)
        join(trainer, dest, timeout_s=10)
        os.kill(dest.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RefitError):
            trainer.nccl_reshard_refit(refit_timeout_s=10)
        assert time.monotonic() - start < 30
        dest.shutdown()
