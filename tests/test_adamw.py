"""The one-pass AdamW kernel (`ops/adamw.py`) in Triton's interpreter on the CPU
(`adamw_check.py`, a process of its own) against torch's fused AdamW: several tensors across
chunk boundaries and of one element, a grad scale, weight decay, a step skipped by found_inf
(nothing changes, step counts included), state tensors replaced between steps; then a bf16
worker's clipped train step through the kernel against the same worker through torch. The
interpreter rounds differently from the GPU (see the script), so the bounds here are loose and
the GPU test (`gpu_tests/test_gpu_adamw.py`) checks bitwise equality."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import in_interpreter, make_hf_model

from policyworker.train import optimizer as optimizer_module

LR = 1e-3


@pytest.mark.processes
def test_kernel_equals_torch_adamw_in_the_interpreter(tmp_path):
    folder = make_hf_model(tmp_path / "m", "llama")
    lines = in_interpreter("adamw_check.py", folder)
    tensors, *workers = (json.loads(line) for line in lines[-3:])
    assert tensors["skip_changed_nothing"] and not tensors["aligned"]
    assert tensors["steps"] == tensors["torch_steps"] == [4.0] * 5
    assert tensors["moved"] > 3 * LR  # every tensor took its steps
    assert tensors["p_err"] < 5e-4 * LR
    assert tensors["m_err"] < 1e-8 and tensors["v_rel"] < 2e-4
    assert tensors["bf16_ulps"] <= 1.0
    assert [w["grad_reduce_in_fp32"] for w in workers] == [True, False]
    for worker in workers:  # fp32 and bf16 gradient buffers
        assert worker["clipped"] and worker["norm_rel"] < 1e-6
        assert worker["moved_min"] > 0.5 * LR
        assert worker["master_err"] < 5e-4 * LR
        assert worker["weights_bf16_ulps"] <= 1.0


def test_kernel_norm_picks_megatrons_gradients(tmp_path):
    """The kernel's grad norm reads DDP's buffers itself (`_norm_params`' main_grad): the same
    tensors, in the same order, as megatron's `get_grads_for_grad_norm` after its
    `prepare_grads` (fp32 buffers: the masters' `.grad` are views of them)."""
    from conftest import make_worker
    from helpers import make_batch

    from policyworker.losses import NLLLoss

    folder = make_hf_model(tmp_path / "m", "qwen2", tie_word_embeddings=True)
    worker = make_worker(folder, precision="bfloat16", train_global_batch_size=2)
    worker.train(make_batch(batch=2, seq=12), NLLLoss())  # on the CPU: torch's path
    (part,) = worker.state.optimizer.chained_optimizers
    part.prepare_grads()
    ours = [p.main_grad for p in optimizer_module._norm_params(part)]
    megatrons = part.get_grads_for_grad_norm()
    assert len(ours) == len(megatrons) == len(part.get_parameters())
    assert [g.data_ptr() for g in ours] == [g.data_ptr() for g in megatrons]
    worker.shutdown()


def test_groups_that_do_not_line_up_are_refused_before_any_launch():
    from policyworker.ops.adamw import AdamWGroup, FusedAdamW

    def group(grads: list[torch.Tensor]) -> AdamWGroup:
        params = [torch.zeros(4), torch.zeros(3)]
        return AdamWGroup(params, [torch.zeros(4), torch.zeros(3)], [torch.zeros(4), torch.zeros(3)],
                          [torch.zeros(()), torch.zeros(())], grads, None, 1e-3, 0.0, (0.9, 0.99),
                          1e-8)  # fmt: skip

    scale, found_inf = torch.ones(()), torch.zeros(())
    with pytest.raises(ValueError, match="sizes differ"):
        FusedAdamW().step([group([torch.zeros(4), torch.zeros(5)])], scale, found_inf)
    with pytest.raises(ValueError, match="different dtypes"):
        grads = [torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16)]
        FusedAdamW().step([group(grads)], scale, found_inf)
    with pytest.raises(ValueError, match="different lengths"):
        FusedAdamW().step([group([torch.zeros(4)])], scale, found_inf)
