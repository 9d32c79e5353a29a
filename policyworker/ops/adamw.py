"""AdamW over fp32 master weights with the bf16 model copy, one Triton kernel over many tensors.

What a bf16 model's optimizer step is on the GPU without Transformer Engine: torch's fused AdamW
over the fp32 masters (it reads and writes masters, gradients and both moments: with a grad scale
it writes the unscaled gradient back), then a second pass that copies every master into its bf16
model weight. Both passes are bound by memory bandwidth. This kernel makes one pass: it reads the
gradient, master and moments once and writes master, moments and the bf16 weight, and never
writes the gradient (nothing reads it after the step; the next step's first gradient overwrites it).
On the MoE benchmark's 2.10B parameters (633 tensors) it took 24.0 ms against torch's 30.9 on
an H100 (`benchmarks/adam_bench.py`, BENCHMARKS.md).

The tensors stay where the optimizer keeps them (a table of their addresses, as torch's
multi-tensor apply does), so checkpoint loads and memory phases, which replace them, need
nothing from here: the table is rebuilt when an address changes.

Numbers: torch 2.11's fused AdamW formulas as written (`ATen/native/cuda/fused_adam_utils.cuh`):
fp32 throughout, its explicit FMAs for the moments, `param -= lr * wd * param` as nvcc contracts
it, IEEE division and square root; the bias corrections from the step count by the device's
`pow`, as torch's kernel computes them. On an H100 masters, moments and bf16 weights came out
bitwise equal to torch's (`adam_bench.py`'s 50M elements; `gpu_tests/test_gpu_adamw.py`). One
difference: a group's params share the step count of its first (they always step together).
On the CPU the worker keeps torch's AdamW; tests run this kernel there in Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 65536
"""Elements of one tensor a program updates (its loop runs BLOCK at a time)."""
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _adamw_kernel(
    tables_ptr,
    chunks_ptr,
    n_tensors,
    consts_ptr,
    scale_ptr,
    inf_ptr,
    GRAD_BF16: tl.constexpr,
    WRITE_MODEL: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    if tl.load(inf_ptr) != 0:
        return  # a non-finite gradient somewhere: nothing changes (torch's found_inf)
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    start = tl.load(chunks_ptr + 2 * pid + 1).to(tl.int64) * CHUNK
    n = tl.load(tables_ptr + 6 * n_tensors + t)
    p_ptr = tl.load(tables_ptr + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(tables_ptr + n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(tables_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    if GRAD_BF16:
        g_ptr = tl.load(tables_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(tables_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    o_ptr = tl.load(tables_ptr + 4 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
    if ALIGNED:  # every tensor starts on a 16-byte boundary (the host checked): vector loads
        p_ptr = tl.multiple_of(p_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        o_ptr = tl.multiple_of(o_ptr, 16)
    # fp32 scalars, as torch's kernel rounds its double arguments
    lr = tl.load(consts_ptr)
    beta1 = tl.load(consts_ptr + 2)
    beta2 = tl.load(consts_ptr + 3)
    eps = tl.load(consts_ptr + 4)
    bias2_sqrt = tl.load(consts_ptr + 6)
    scale = tl.load(scale_ptr)
    step_size = tl.math.div_rn(lr, tl.load(consts_ptr + 5))
    lr_wd = lr * tl.load(consts_ptr + 1)
    # whole blocks without a mask (a mask of unknown length keeps Triton from vector loads),
    # then the tensor's last, partial block
    end = tl.minimum(start + CHUNK, n)
    whole = (end - start) // BLOCK
    for i in range(whole):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        _update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, end, scale, lr_wd, beta1, beta2,
                eps, step_size, bias2_sqrt, False, WRITE_MODEL)  # fmt: skip
    if start + whole * BLOCK < end:
        offs = start + whole * BLOCK + tl.arange(0, BLOCK)
        _update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, end, scale, lr_wd, beta1, beta2,
                eps, step_size, bias2_sqrt, True, WRITE_MODEL)  # fmt: skip


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, end, scale, lr_wd, beta1, beta2, eps,
            step_size, bias2_sqrt, MASKED: tl.constexpr, WRITE_MODEL: tl.constexpr):  # fmt: skip
    mask = offs < end if MASKED else None
    g = tl.math.div_rn(tl.load(g_ptr + offs, mask=mask).to(tl.float32), scale)
    p = tl.load(p_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = tl.fma(-lr_wd, p, p)
    m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
    gg = g * g
    v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
    denom = tl.math.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    p = p - tl.math.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WRITE_MODEL:
        tl.store(o_ptr + offs, p.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)


@dataclass
class AdamWGroup:
    """One param group's tensors, index-aligned: fp32 masters, their Adam moments and step
    counts (torch's state, updated in place), gradients (fp32 or bf16) and the bf16 model
    weights each master is copied into (None: the masters are the model's own weights)."""

    params: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    grads: list[torch.Tensor]
    model: list[torch.Tensor] | None
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float


class _Tables:
    """A group's address and chunk tables on the device, rebuilt (and the group's tensors
    checked) only when an address or a size changes: building them copies to the device, which
    waits for it."""

    def __init__(self) -> None:
        self.key: tuple[int, ...] = ()
        self.tables = self.chunks = torch.empty(0)
        self.aligned = False

    def get(self, group: AdamWGroup) -> _Tables:
        model = group.model if group.model is not None else group.params
        lists = (group.params, group.exp_avgs, group.exp_avg_sqs, group.grads, model)
        addresses = [t.data_ptr() for tensors in lists for t in tensors]
        sizes = [p.numel() for p in group.params]
        key = (*addresses, *sizes)
        if key != self.key:  # new tensors: checked once, not every step
            _check(group)
            device = group.params[0].device
            self.tables = torch.tensor([*addresses, *[0] * len(sizes), *sizes], device=device)
            chunks = [(t, c) for t, n in enumerate(sizes) for c in range(triton.cdiv(n, CHUNK))]
            self.chunks = torch.tensor(chunks, dtype=torch.int32, device=device).flatten()
            self.aligned = all(a % 16 == 0 for a in addresses)
            self.key = key
        return self


class FusedAdamW:
    """Steps AdamW groups with the kernel; keeps each group's tables between steps."""

    def __init__(self) -> None:
        self._tables: list[_Tables] = []

    @torch.no_grad()
    def step(
        self, groups: list[AdamWGroup], grad_scale: torch.Tensor, found_inf: torch.Tensor
    ) -> None:
        """One step of every group: gradients divided by `grad_scale` (a device fp32 scalar),
        nothing changed where `found_inf` (a device fp32 scalar) is 1, as torch's fused AdamW:
        the step counts advance only where it is 0."""
        while len(self._tables) < len(groups):
            self._tables.append(_Tables())
        for group, cache in zip(groups, self._tables, strict=False):
            if group.params:
                _step_group(group, cache.get(group), grad_scale, found_inf)


def _step_group(
    group: AdamWGroup, t: _Tables, grad_scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    torch._foreach_add_(group.steps, 1.0)
    hyper = (group.lr, group.weight_decay, *group.betas, group.eps)
    consts = torch.tensor(hyper, dtype=torch.float32).to(t.tables.device, non_blocking=True)
    bias = 1 - torch.pow(consts[2:4], group.steps[0])  # the group's step counts move together
    consts = torch.cat([consts, bias[:1], bias[1:].sqrt()])
    _adamw_kernel[(t.chunks.numel() // 2,)](
        t.tables,
        t.chunks,
        len(group.params),
        consts,
        grad_scale,
        found_inf,
        GRAD_BF16=group.grads[0].dtype == torch.bfloat16,
        WRITE_MODEL=group.model is not None,
        CHUNK=CHUNK,
        BLOCK=BLOCK,
        ALIGNED=t.aligned,
        num_warps=NUM_WARPS,
    )
    torch._foreach_sub_(group.steps, [found_inf] * len(group.steps))


def _check(group: AdamWGroup) -> None:
    n = len(group.params)
    lists = [group.exp_avgs, group.exp_avg_sqs, group.steps, group.grads]
    if group.model is not None:
        lists.append(group.model)
    if any(len(x) != n for x in lists):
        raise ValueError("AdamWGroup: lists of different lengths")
    for i, p in enumerate(group.params):
        same = [group.exp_avgs[i], group.exp_avg_sqs[i], group.grads[i]]
        if group.model is not None:
            same.append(group.model[i])
        if any(t.numel() != p.numel() or not t.is_contiguous() for t in [p, *same]):
            raise ValueError(f"AdamWGroup: tensor {i}: sizes differ or not contiguous")
    if len({g.dtype for g in group.grads}) > 1:
        raise ValueError("AdamWGroup: gradients of different dtypes")
