"""Runs `ops.adamw`'s kernel in Triton's interpreter (on the CPU, numpy) against torch's fused
AdamW, one JSON line; with a model folder, also a bf16 worker's train steps with the kernel
against the same worker's torch path. Run by `test_adamw.py` with TRITON_INTERPRET=1 (Triton
reads it when the kernel is defined, so it needs a process of its own).

The interpreter is not the GPU: it evaluates `tl.fma` as a product and a sum (two roundings,
and the moments' `g - beta1 * g` cancels), and rounds fp32 to bf16 by truncation. So here the
numbers are checked to a tolerance and the bf16 copy to one bf16 ulp; the GPU test
(`gpu_tests/test_gpu_adamw.py`) checks them bitwise.
"""

from __future__ import annotations

import json
import os
import sys

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch

from policyworker.ops.adamw import CHUNK, AdamWGroup, FusedAdamW

LR, WD = 1e-3, 0.5


def _bf16_ulps(model: torch.Tensor, master: torch.Tensor) -> float:
    """The bf16 copy's distance from its master, in bf16 ulps of the master."""
    ulp = master.abs().clamp_min(1e-30).log2().floor().exp2() * 2.0**-7
    return float(((model.float() - master).abs() / ulp).max())


def kernel_against_torch() -> dict[str, object]:
    """Tensors across chunk boundaries and of one element; a step skipped by found_inf; the
    tables rebuilt when the state is replaced (as a checkpoint load replaces it)."""
    torch.manual_seed(0)
    sizes = [CHUNK + 4464, 3, 130, 1, CHUNK + 464]
    masters = [torch.randn(n) * 0.02 for n in sizes]
    grads = [torch.randn(n) * 1e-3 for n in sizes]
    ref = [torch.nn.Parameter(p.clone()) for p in masters]
    torch_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=WD, fused=True)
    ours = [p.clone() for p in masters]
    m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    steps = [torch.zeros(()) for _ in sizes]
    # the bf16 weights as views of one buffer, as in megatron's DDP: some not 16-byte aligned
    model = list(torch.empty(sum(sizes), dtype=torch.bfloat16).split(sizes))
    kernel, scale, out = FusedAdamW(), torch.tensor(1.37), {}
    for i in range(5):
        found_inf = torch.tensor(float(i == 2))
        before = [t.clone() for t in [*ours, *m, *v, *steps, *model]]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        torch_opt.grad_scale, torch_opt.found_inf = scale, found_inf
        torch_opt.step()
        if i == 3:  # fresh tensors with the same values: the tables must follow them
            m, v = [t.clone() for t in m], [t.clone() for t in v]
        group = AdamWGroup(ours, m, v, steps, grads, model, LR, WD, (0.9, 0.999), 1e-8)
        kernel.step([group], scale, found_inf)
        after = [*ours, *m, *v, *steps, *model]
        if i == 2:
            out["skip_changed_nothing"] = all(
                torch.equal(a, b) for a, b in zip(before, after, strict=True)
            )
    states = [torch_opt.state[p] for p in ref]
    out["aligned"] = kernel._tables[0].aligned
    out["steps"] = [float(s) for s in steps]
    out["torch_steps"] = [float(s["step"]) for s in states]
    out["p_err"] = max(float((a - p.data).abs().max()) for a, p in zip(ours, ref, strict=True))
    out["m_err"] = max(
        float((a - s["exp_avg"]).abs().max()) for a, s in zip(m, states, strict=True)
    )
    out["v_rel"] = max(
        float(((a - s["exp_avg_sq"]).abs() / s["exp_avg_sq"]).max())
        for a, s in zip(v, states, strict=True)
    )
    out["moved"] = min(float((a - b).abs().max()) for a, b in zip(ours, masters, strict=True))
    out["bf16_ulps"] = max(_bf16_ulps(w, p) for w, p in zip(model, ours, strict=True))
    return out


def worker_against_torch(folder: str, grad_reduce_in_fp32: bool) -> dict[str, object]:
    """A bf16 worker's clipped train step, once with the kernel (as on a GPU) and once with
    torch's fused AdamW: the masters, the bf16 weights against them, and the grad norm (the
    kernel's path reads DDP's buffers, fp32 or bf16, where torch's reads the masters' fp32
    `.grad` copies). One step: Adam turns
    the interpreter's bf16 truncation (an ulp in some weights) into differences of up to lr in
    the next step's update of near-zero gradients."""
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import make_batch

    from policyworker.config import OptimizerConfig, PolicyConfig
    from policyworker.losses import NLLLoss
    from policyworker.train import optimizer as optimizer_module
    from policyworker.worker import MegatronPolicyWorker

    runs = []
    for kernel in (True, False):
        worker = MegatronPolicyWorker(
            PolicyConfig(
                model_name=folder,
                precision="bfloat16",
                train_global_batch_size=4,
                train_micro_batch_size=2,
                max_total_sequence_length=64,
                max_grad_norm=0.05,
                optimizer=OptimizerConfig(
                    lr=LR, weight_decay=0.1, grad_reduce_in_fp32=grad_reduce_in_fp32
                ),
            )
        )
        (part,) = worker.state.optimizer.chained_optimizers
        if kernel:  # what `build_optimizer` chooses on a GPU
            norm_params = optimizer_module._norm_params(part)
            optimizer_module._KERNEL[part] = optimizer_module._KernelPart(FusedAdamW(), norm_params)
        assert (part in optimizer_module._KERNEL) == kernel
        initial = [p.detach().clone() for g in part.fp32_from_float16_groups for p in g]
        norm = worker.train(make_batch(batch=4, seq=12, seed=1), NLLLoss())["grad_norm"]
        masters = [p.detach().clone() for g in part.fp32_from_float16_groups for p in g]
        weights = [p.detach().clone() for g in part.float16_groups for p in g]
        runs.append((norm, initial, masters, weights))
        worker.shutdown()
    (norm, initial, masters_k, weights_k), (norm_t, _, masters_t, _) = runs
    pairs = zip(masters_k, masters_t, strict=True)
    return {
        "grad_reduce_in_fp32": grad_reduce_in_fp32,
        "norm_rel": abs(norm - norm_t) / norm_t,
        "clipped": norm > 0.05,
        "master_err": max(float((a - b).abs().max()) for a, b in pairs),
        "moved_min": min(
            float((a - b).abs().max()) for a, b in zip(masters_t, initial, strict=True)
        ),
        "weights_bf16_ulps": max(
            _bf16_ulps(w, p) for w, p in zip(weights_k, masters_k, strict=True)
        ),
    }


if __name__ == "__main__":
    print(json.dumps(kernel_against_torch()))
    if len(sys.argv) > 1:
        for fp32_buffers in (True, False):
            print(json.dumps(worker_against_torch(sys.argv[1], fp32_buffers)))
