"""GPU checks of the IPC refit (run on the device, not in CI): into a generation process on the
same GPU — straight into its shared staging (CUDA IPC of the engine's memory) and through the
trainer's CUDA IPC buffers — bf16, bitwise over several refits (the engine adopting its staging);
the checksum on the device.

python -m pytest -q gpu_tests/test_gpu_refit.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import make_batch, make_hf_model
from test_gpu_parity import MEDIUM, bf16_trainer
from test_refit import send_tampered

from policyworker.generation.process import GenerationProcess
from policyworker.losses import NLLLoss
from policyworker.refit.layout import RefitError

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)


@pytest.mark.parametrize("shared", [True, False], ids=["direct", "buffers"])
def test_cuda_ipc_refit_is_exact_and_the_checksum_catches_a_flip(tmp_path, shared):
    folder = make_hf_model(tmp_path, "llama", **MEDIUM)
    worker = bf16_trainer(folder)
    data = make_batch(batch=4, seq=100, vocab=1024)
    worker.train(data, NLLLoss())
    info = worker.prepare_refit_info()
    with GenerationProcess(str(folder), info, device="cuda:0", shared_staging=shared) as gen:
        for version in (1, 2, 3):
            if version > 1:
                worker.train(data, NLLLoss())
            gen.begin_refit_ipc(worker.get_zmq_address())
            report = worker.stream_weights_via_ipc_zmq(buffer_size_bytes=1 << 20)
            assert gen.end_refit() == report.version == version and report.buckets > 1
            got = gen.weights()
            assert all(torch.equal(got[n], t.cpu()) for n, t in worker.export_hf_weights())
        gen.begin_refit_ipc(worker.get_zmq_address())

        def flip(buffer):
            buffer[7] ^= 4

        with pytest.raises(RefitError, match="checksum"):
            send_tampered(worker, flip, bucket_bytes=1 << 20, timeout_s=30, version=4)
        with pytest.raises(RefitError, match="checksum"):
            gen.end_refit()
        assert gen.version() == 3
        after = gen.weights()
        assert all(torch.equal(after[n], got[n]) for n in got)
