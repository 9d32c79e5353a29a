"""GPU check of the async save (run on the device, not in CI): the checkpoint holds the state
as of the call, although training goes on while the writer runs; loading it restores weights and
optimizer state bit for bit.

python -m pytest -q gpu_tests/test_gpu_checkpoint.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import make_batch, make_hf_model
from test_gpu_parity import MEDIUM, bf16_trainer
from test_split_step import snapshot

from policyworker.losses import NLLLoss

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)


def test_async_save_holds_the_state_of_the_call(tmp_path):
    folder = make_hf_model(tmp_path, "llama", **MEDIUM)
    worker = bf16_trainer(folder)
    data = make_batch(batch=4, seq=100, vocab=1024)
    worker.train(data, NLLLoss())
    saved = snapshot(worker)
    w, o = tmp_path / "ckpt" / "weights", tmp_path / "ckpt" / "optim"
    for _ in range(2):  # the second save reuses the staging memory of the first
        worker.save_checkpoint(w, o, async_save=True)
        worker.train(data, NLLLoss())  # the live state moves on while the writer runs
        worker.finalize_async_save()
        moved = snapshot(worker)
        assert not all(torch.equal(moved["params"][n], saved["params"][n]) for n in saved["params"])
        worker.load_checkpoint(w, o)
        loaded = snapshot(worker)
        assert all(torch.equal(loaded["params"][n], p) for n, p in saved["params"].items())
        for a, b in zip(loaded["optimizer"], saved["optimizer"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        w, o = tmp_path / "again" / "weights", tmp_path / "again" / "optim"
