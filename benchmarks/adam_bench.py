"""The optimizer phase of the MoE train step (#27), alone: what we run beside one flat kernel.

The 2.10B-parameter Qwen3-MoE shape of `moe_bench.py --layers 6` (633 tensors, experts per
expert), fp32 master weights, gradients and Adam moments, bf16 model weights:

* ours (now):  torch's fused AdamW over the per-parameter masters (megatron's fp32 copies; the
               grad scale is our clip folded in) + one `_foreach_copy_` of the masters into the
               bf16 weights: what `train.optimizer.optimizer_step` runs;
* flat torch:  the same two ops over one flat tensor (are the 633 tensors the cost?);
* flat kernel: one Triton kernel over flat buffers: Adam and the bf16 copy in one pass, the
               gradients not written back (torch's kernel writes the unscaled gradient back
               whenever a grad scale is given).

A candidate for a flat-buffer optimizer, not yet used by the worker. Its numerics against torch's
fused AdamW are reported (bitwise fractions after 3 steps on a 50M-element slice). The first
kernel does its scalar math in fp64, while torch 2.11's kernel is all fp32 with explicit FMAs
(`ATen/native/cuda/fused_adam_utils.cuh`), so its moments differ in the last bit; the second
(`_fp32`) follows torch's formulas as written, to be bitwise equal.

    python benchmarks/adam_bench.py                      # GPU
    TRITON_INTERPRET=1 python benchmarks/adam_bench.py   # CPU smoke: a tiny shape, numerics only
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _adamw_bf16(
    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, c_ptr, scale_ptr, inf_ptr, n, BLOCK: tl.constexpr
):
    """torch's CUDA fused AdamW (fused_adam_utils.cuh) element by element, fp64 where it is
    (its lr, betas, eps and weight decay are doubles), plus the bf16 model copy."""
    if tl.load(inf_ptr) != 0:
        return
    lrwd = tl.load(c_ptr + 0)
    beta1 = tl.load(c_ptr + 1)
    one_m_b1 = tl.load(c_ptr + 2)
    beta2 = tl.load(c_ptr + 3)
    one_m_b2 = tl.load(c_ptr + 4)
    eps = tl.load(c_ptr + 5)
    step_size = tl.load(c_ptr + 6).to(tl.float32)
    bc2_sqrt = tl.load(c_ptr + 7).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = (tl.load(g_ptr + offs, mask=mask).to(tl.float64) / scale).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p64 = p.to(tl.float64)
    p = (p64 - lrwd * p64).to(tl.float32)
    g64 = g.to(tl.float64)
    m = (beta1 * m.to(tl.float64) + one_m_b1 * g64).to(tl.float32)
    v = (beta2 * v.to(tl.float64) + one_m_b2 * g64 * g64).to(tl.float32)
    d = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt)
    denom = (d.to(tl.float64) + eps).to(tl.float32)
    p = p - tl.math.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(out_ptr + offs, p.to(tl.bfloat16), mask=mask)


def consts(
    step: int, lr: float = 1e-5, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
    wd: float = 0.01, device: str = DEV,
) -> torch.Tensor:  # fmt: skip
    """The kernel's scalars (fp64), rounded to fp32 where torch rounds them."""

    def f32(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32))

    bc1 = f32(1 - b1**step)
    step_size = f32(lr / bc1)
    bc2_sqrt = float(torch.tensor(f32(1 - b2**step), dtype=torch.float32).sqrt())
    return torch.tensor(
        [lr * wd, b1, 1 - b1, b2, 1 - b2, eps, step_size, bc2_sqrt],
        dtype=torch.float64,
        device=device,
    )


def triton_step(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    scale: torch.Tensor, inf: torch.Tensor, step: int,
) -> None:  # fmt: skip
    n = p.numel()
    BLOCK = 2048
    _adamw_bf16[(triton.cdiv(n, BLOCK),)](p, g, m, v, out, consts(step), scale, inf, n, BLOCK=BLOCK)


def reference_step(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
    step: int,
) -> None:  # fmt: skip
    """The kernel's formulas in torch, fp64 without FMA (on the GPU the compiler contracts some
    into FMAs: a few elements differ in the last bit)."""
    c = consts(step, device=p.device)
    g = (g.double() / scale.double()).float()
    p64 = p.double()
    p.copy_((p64 - c[0] * p64).float())
    m.copy_((c[1] * m.double() + c[2] * g.double()).float())
    v.copy_((c[3] * v.double() + c[4] * g.double() * g.double()).float())
    d = v.sqrt() / c[7].float()
    denom = (d.double() + c[5]).float()
    p.sub_((c[6].float() * m) / denom)


@triton.jit
def _adamw_bf16_fp32(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, c_ptr, scale_ptr, inf_ptr, n,
                     BLOCK: tl.constexpr):  # fmt: skip
    """torch 2.11's formulas as they are: fp32 scalars, its explicit FMAs for the moments, and
    `param -= lr * wd * param` as the FMA nvcc contracts it to (not yet measured on a GPU)."""
    if tl.load(inf_ptr) != 0:
        return
    lrwd = tl.load(c_ptr + 0)
    beta1 = tl.load(c_ptr + 1)
    beta2 = tl.load(c_ptr + 2)
    eps = tl.load(c_ptr + 3)
    step_size = tl.load(c_ptr + 4)
    bc2_sqrt = tl.load(c_ptr + 5)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.math.div_rn(tl.load(g_ptr + offs, mask=mask), tl.load(scale_ptr))
    p = tl.load(p_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = tl.fma(-lrwd, p, p)
    m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
    gg = g * g
    v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.math.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(out_ptr + offs, p.to(tl.bfloat16), mask=mask)


def consts_fp32(
    step: int, lr: float = 1e-5, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
    wd: float = 0.01, device: str = DEV,
) -> torch.Tensor:  # fmt: skip
    """The scalars as torch's kernel makes them: fp32, the bias corrections by the device's pow
    (tensor to tensor, so no shortcut for small exponents)."""

    def t(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32, device=device)

    lr_, step_ = t(lr), t(float(step))
    bc1 = 1 - torch.pow(t(b1), step_)
    bc2_sqrt = torch.sqrt(1 - torch.pow(t(b2), step_))
    return torch.stack([lr_ * t(wd), t(b1), t(b2), t(eps), lr_ / bc1, bc2_sqrt])


def triton_step_fp32(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    scale: torch.Tensor, inf: torch.Tensor, step: int,
) -> None:  # fmt: skip
    n, block = p.numel(), 2048
    _adamw_bf16_fp32[(triton.cdiv(n, block),)](
        p, g, m, v, out, consts_fp32(step, device=p.device.type), scale, inf, n, BLOCK=block
    )


def shapes(
    layers: int = 6, h: int = 2048, q: int = 4096, kv: int = 512, experts: int = 48,
    ffn: int = 768, vocab: int = 151936,
) -> list[tuple[int, ...]]:  # fmt: skip
    """The parameter shapes of the Qwen3-MoE model, in order (experts per expert)."""
    s: list[tuple[int, ...]] = [(vocab, h)]
    for _ in range(layers):
        s += [(h,), (q, h), (kv, h), (kv, h), (128,), (128,), (h, q), (h,), (experts, h)]
        s += [(2 * ffn, h), (h, ffn)] * experts
    return [*s, (h,), (vocab, h)]


def _timed(fn, iters: int = 5) -> float:
    """ms per call on the GPU (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main() -> None:
    small = DEV == "cpu"
    sh = shapes(layers=1, h=64, q=128, kv=32, experts=4, ffn=16, vocab=300) if small else shapes()
    sizes = [torch.Size(s).numel() for s in sh]
    n = sum(sizes)
    gen = torch.Generator(device=DEV).manual_seed(0)
    P = torch.randn(n, device=DEV, generator=gen) * 0.02
    G = torch.randn(n, device=DEV, generator=gen) * 1e-3
    M, V = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    OUT = torch.empty(n, device=DEV, dtype=torch.bfloat16)
    ps = [torch.nn.Parameter(x) for x in torch.split(P, sizes)]
    for p, gv in zip(ps, torch.split(G, sizes), strict=True):
        p.grad = gv
    outs = list(torch.split(OUT, sizes))
    scale, inf = torch.tensor(1.0, device=DEV), torch.tensor(0.0, device=DEV)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    res: dict[str, object] = {"params": n, "tensors": len(sizes), "device": name}

    # numerics on a slice: torch fused (what we run) vs the kernel, 3 steps from equal states,
    # a grad scale that is not 1 (the clip folded in)
    k = min(n, 50_000_000)
    g1 = G[:k].clone()
    cs = torch.tensor(1.37, device=DEV)
    tp = torch.nn.Parameter(P[:k].clone())
    tp.grad = g1.clone()
    opt = torch.optim.AdamW([tp], lr=1e-5, weight_decay=0.01, fused=True)
    p2, m2, v2 = P[:k].clone(), torch.zeros(k, device=DEV), torch.zeros(k, device=DEV)
    o2 = torch.empty(k, device=DEV, dtype=torch.bfloat16)
    p4, m4, v4, o4 = p2.clone(), m2.clone(), v2.clone(), o2.clone()
    for step in range(1, 4):
        tp.grad.copy_(g1)  # torch writes the unscaled grads back
        opt.grad_scale, opt.found_inf = cs, inf
        opt.step()
        triton_step(p2, g1, m2, v2, o2, cs, inf, step)
        triton_step_fp32(p4, g1, m4, v4, o4, cs, inf, step)
    st = opt.state[tp]
    res["fp32_variant_bitwise_p_m_v"] = [
        float((a == b).float().mean())
        for a, b in ((tp.data, p4), (st["exp_avg"], m4), (st["exp_avg_sq"], v4))
    ]
    res["bitwise_p"] = (tp.data == p2).float().mean().item()
    res["bitwise_m"] = (st["exp_avg"] == m2).float().mean().item()
    res["bitwise_v"] = (st["exp_avg_sq"] == v2).float().mean().item()
    res["max_abs_p"] = (tp.data - p2).abs().max().item()
    res["bf16_equal"] = (tp.data.bfloat16() == o2).float().mean().item()
    p3, m3, v3 = P[:k].clone(), torch.zeros(k, device=DEV), torch.zeros(k, device=DEV)
    for step in range(1, 4):
        reference_step(p3, g1, m3, v3, cs, step)
    res["kernel_equals_fp64_reference"] = [
        float((a == b).float().mean()) for a, b in ((p2, p3), (m2, m3), (v2, v3))
    ]
    inf1 = torch.tensor(1.0, device=DEV)
    before = p2.clone()
    triton_step(p2, g1, m2, v2, o2, cs, inf1, 4)
    res["found_inf_skips"] = bool(torch.equal(before, p2))
    del g1, tp, opt, p2, m2, v2, o2, st, p3, m3, v3, before, p4, m4, v4, o4
    if small:
        print(json.dumps(res))
        return

    def fused(params: list[torch.nn.Parameter]):
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)

        def step() -> None:
            opt.grad_scale, opt.found_inf = scale, inf
            opt.step()

        return opt, step

    opt, step = fused(ps)
    res["now_adam_ms"] = _timed(step)
    res["now_copy_ms"] = _timed(lambda: torch._foreach_copy_(outs, ps))
    del opt, step
    flat = torch.nn.Parameter(P)
    flat.grad = G
    opt, step = fused([flat])
    res["flat_torch_adam_ms"] = _timed(step)
    res["flat_torch_copy_ms"] = _timed(lambda: OUT.copy_(P))
    del opt, step
    steps = iter(range(1, 1000))
    res["flat_kernel_ms"] = _timed(lambda: triton_step(P, G, M, V, OUT, scale, inf, next(steps)))
    res["flat_kernel_fp32_ms"] = _timed(
        lambda: triton_step_fp32(P, G, M, V, OUT, scale, inf, next(steps))
    )
    res["now_ms"] = res["now_adam_ms"] + res["now_copy_ms"]
    res["flat_torch_ms"] = res["flat_torch_adam_ms"] + res["flat_torch_copy_ms"]
    res["flat_kernel_ideal_ms"] = n * (16 + 12 + 2) / 3.35e12 * 1e3  # H100 HBM3 bytes/s
    res["speedup_flat_kernel"] = res["now_ms"] / res["flat_kernel_ms"]
    print(json.dumps(res))


if __name__ == "__main__":
    with torch.no_grad():
        main()
