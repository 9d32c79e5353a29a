"""Our one-pass AdamW kernel (`ops.adamw`) against torch's fused AdamW on the GPU: bitwise.

python -m pytest -q gpu_tests/test_gpu_adamw.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import make_batch, make_hf_model
from test_gpu_parity import bf16_trainer

from policyworker.config import OptimizerConfig
from policyworker.losses import NLLLoss
from policyworker.ops.adamw import AdamWGroup, FusedAdamW
from policyworker.train import optimizer as optimizer_module

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

SIZES = [300_001, 7, 2048 * 3, 1, 65_536 * 2 + 5]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_bitwise_torch_fused_adamw(grad_dtype, packed):
    """Four steps (one skipped by found_inf) with a grad scale that is not 1 and weight decay:
    masters, moments and step counts bitwise equal to torch's fused AdamW, the bf16 weights
    equal to the masters rounded. bf16 gradients: torch is given them in fp32 (what megatron
    hands it). `packed`: the bf16 weights are views of one buffer, as in megatron's DDP, at
    offsets that are not 16-byte aligned (the kernel's unvectorized path)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    masters = [torch.randn(n, device="cuda", generator=gen) * 0.02 for n in SIZES]
    grads = [(torch.randn(n, device="cuda", generator=gen) * 1e-3).to(grad_dtype) for n in SIZES]
    ref = [torch.nn.Parameter(p.clone()) for p in masters]
    torch_opt = torch.optim.AdamW(ref, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    ours = [p.clone() for p in masters]
    m = [torch.zeros_like(p) for p in ours]
    v = [torch.zeros_like(p) for p in ours]
    steps = [torch.zeros((), device="cuda") for _ in ours]
    model = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in SIZES]
    if packed:
        model = list(torch.empty(sum(SIZES), device="cuda", dtype=torch.bfloat16).split(SIZES))
        assert any(w.data_ptr() % 16 for w in model)
    kernel, scale = FusedAdamW(), torch.tensor(1.37, device="cuda")
    for i in range(4):
        found_inf = torch.tensor(float(i == 2), device="cuda")
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.to(torch.float32, copy=True)  # torch writes the unscaled grad back
        torch_opt.grad_scale, torch_opt.found_inf = scale, found_inf
        torch_opt.step()
        group = AdamWGroup(ours, m, v, steps, grads, model, 3e-4, 0.1, (0.9, 0.95), 1e-8)
        kernel.step([group], scale, found_inf)
    for i, p in enumerate(ref):
        state = torch_opt.state[p]
        assert torch.equal(ours[i], p.data), i
        assert torch.equal(m[i], state["exp_avg"]), i
        assert torch.equal(v[i], state["exp_avg_sq"]), i
        assert torch.equal(steps[i], state["step"]) and steps[i].item() == 3.0
        assert torch.equal(model[i], ours[i].bfloat16()), i


def _train(folder, kernel: bool, fp32_buffers: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = OptimizerConfig(lr=1e-3, weight_decay=0.1, grad_reduce_in_fp32=fp32_buffers)
    worker = bf16_trainer(folder, max_grad_norm=0.5, optimizer=opt)  # clipped: grad scale not 1
    (part,) = worker.state.optimizer.chained_optimizers
    assert part in optimizer_module._KERNEL  # chosen at build on the GPU
    if not kernel:  # what the CPU runs: torch's fused AdamW and the foreach copy
        del optimizer_module._KERNEL[part]
    batch = make_batch(batch=4, seq=128, vocab=1024, seed=3)
    losses = [worker.train(batch, NLLLoss())["loss"] for _ in range(3)]
    weights = {name: t.detach().clone() for name, t in worker.export_hf_weights()}
    worker.shutdown()
    return losses, weights


@pytest.mark.parametrize("fp32_buffers", [True, False])
def test_worker_steps_equal_with_and_without_the_kernel(tmp_path, fp32_buffers):
    """Three clipped bf16 train steps of a worker: the same losses and bitwise the same weights
    with the kernel as with torch's fused AdamW; with fp32 gradient buffers and with bf16 ones
    (the kernel reads those directly, torch's path copies them into fp32 `.grad`s)."""
    folder = make_hf_model(tmp_path, vocab_size=1024, hidden_size=256, intermediate_size=512)
    losses_kernel, w_kernel = _train(folder, kernel=True, fp32_buffers=fp32_buffers)
    losses_torch, w_torch = _train(folder, kernel=False, fp32_buffers=fp32_buffers)
    assert losses_kernel == losses_torch
    assert w_kernel.keys() == w_torch.keys()
    for name, value in w_kernel.items():
        assert torch.equal(value, w_torch[name]), name
