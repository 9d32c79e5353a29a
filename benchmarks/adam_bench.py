"""The optimizer phase of the MoE train step (#27), alone: torch's two passes against our one.

The 2.10B-parameter Qwen3-MoE shape of `moe_bench.py --layers 6` (633 tensors, experts per
expert), fp32 master weights, gradients and Adam moments, bf16 model weights:

* torch:      torch's fused AdamW over the per-parameter masters (the grad scale is our clip
              folded in) + one `_foreach_copy_` of the masters into the bf16 weights: what
              `train.optimizer.optimizer_step` runs on the CPU, and ran on the GPU before;
* flat torch: the same two ops over one flat tensor (are the 633 tensors the cost?);
* ours:       `ops.adamw.FusedAdamW` over the same 633 tensors: Adam and the bf16 copy in one
              pass, the gradients not written back: what the worker runs on the GPU.

Numerics: ours against torch after 3 steps with a grad scale that is not 1 and one step skipped
by found_inf (fractions of bitwise-equal elements of masters, moments and bf16 weights).

    python benchmarks/adam_bench.py                      # GPU
    TRITON_INTERPRET=1 python benchmarks/adam_bench.py   # CPU smoke: a tiny shape, numerics only
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # the CPU smoke runs the kernel in Triton's interpreter, patched as the tests do
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    import interpreter  # noqa: F401

from policyworker.ops.adamw import AdamWGroup, FusedAdamW  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from train_bench import event_ms  # noqa: E402


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


def _timed(fn: Callable[[], object], iters: int = 5) -> float:
    """ms per call on the GPU (after one warm-up call)."""
    return event_ms(fn, iters, warmup=1)


def numerics(sizes: list[int], scale: torch.Tensor) -> dict[str, object]:
    """Ours against torch from equal states: 3 steps and one skipped by found_inf."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(n, device=DEV, generator=gen) * 0.02) for n in sizes]
    grads = [torch.randn(n, device=DEV, generator=gen) * 1e-3 for n in sizes]
    out = [torch.empty(n, device=DEV, dtype=torch.bfloat16) for n in sizes]
    torch_opt = torch.optim.AdamW(masters, lr=1e-5, weight_decay=0.01, fused=True)
    ours = [p.detach().clone() for p in masters]
    m, v = [torch.zeros_like(x) for x in ours], [torch.zeros_like(x) for x in ours]
    steps = [torch.zeros((), device=DEV) for _ in ours]
    ours_out = [torch.empty_like(x) for x in out]
    group = AdamWGroup(ours, m, v, steps, grads, ours_out, 1e-5, 0.01, (0.9, 0.999), 1e-8)
    kernel = FusedAdamW()
    for i in range(4):
        found_inf = torch.tensor(float(i == 1), device=DEV)
        for p, g in zip(masters, grads, strict=True):
            p.grad = g.clone()  # torch writes the unscaled gradient back
        torch_opt.grad_scale, torch_opt.found_inf = scale, found_inf
        torch_opt.step()
        torch._foreach_copy_(out, masters)
        kernel.step([group], scale, found_inf)
    states = [torch_opt.state[p] for p in masters]
    n = sum(sizes)

    def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return sum(int((x == y).sum()) for x, y in zip(a, b, strict=True)) / n

    return {
        "bitwise_p_m_v_bf16": [
            equal(ours, [p.data for p in masters]),
            equal(m, [s["exp_avg"] for s in states]),
            equal(v, [s["exp_avg_sq"] for s in states]),
            equal(ours_out, out),
        ],
        "steps_equal": all(bool(a == s["step"]) for a, s in zip(steps, states, strict=True)),
    }


def timings(sizes: list[int], scale: torch.Tensor) -> dict[str, float]:
    """ms per step: flat torch, torch per tensor, ours (on torch's state), one set of buffers."""
    n, res = sum(sizes), {}
    P, G = torch.randn(n, device=DEV) * 0.02, torch.randn(n, device=DEV) * 1e-3
    out = torch.empty(n, device=DEV, dtype=torch.bfloat16)
    inf = torch.tensor(0.0, device=DEV)
    flat = torch.nn.Parameter(P)
    flat.grad = G
    res["flat_torch_ms"] = _adam_ms([flat], scale, inf) + _timed(lambda: out.copy_(P))
    masters = [torch.nn.Parameter(x) for x in torch.split(P, sizes)]
    for p, g in zip(masters, torch.split(G, sizes), strict=True):
        p.grad = g
    outs = list(torch.split(out, sizes))
    torch_opt = torch.optim.AdamW(masters, lr=1e-5, weight_decay=0.01, fused=True)
    torch_opt.grad_scale, torch_opt.found_inf = scale, inf
    res["torch_adam_ms"] = _timed(torch_opt.step)
    res["torch_copy_ms"] = _timed(lambda: torch._foreach_copy_(outs, masters))
    res["torch_ms"] = res["torch_adam_ms"] + res["torch_copy_ms"]
    states = [torch_opt.state[p] for p in masters]
    group = AdamWGroup(
        [p.data for p in masters],
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["step"] for s in states],
        [p.grad for p in masters],
        outs,
        1e-5,
        0.01,
        (0.9, 0.999),
        1e-8,
    )
    kernel = FusedAdamW()
    res["ours_ms"] = _timed(lambda: kernel.step([group], scale, inf))
    res["ideal_ms"] = n * (16 + 12 + 2) / 3.35e12 * 1e3  # its bytes at H100 HBM3's 3.35 TB/s
    res["speedup"] = res["torch_ms"] / res["ours_ms"]
    return res


def _adam_ms(params: list[torch.nn.Parameter], scale: torch.Tensor, inf: torch.Tensor) -> float:
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
    opt.grad_scale, opt.found_inf = scale, inf
    return _timed(opt.step)


def main() -> None:
    small = DEV == "cpu"
    sh = shapes(layers=1, h=64, q=128, kv=32, experts=4, ffn=16, vocab=300) if small else shapes()
    sizes = [torch.Size(s).numel() for s in sh]
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    res: dict[str, object] = {"params": sum(sizes), "tensors": len(sizes), "device": name}
    scale = torch.tensor(1.37, device=DEV)  # the clip folded in: not 1
    # numerics on the first layers' tensors (~50M elements on the GPU shape)
    layers = sizes[1:]
    k = next((i for i in range(len(layers)) if sum(layers[: i + 1]) > 50_000_000), len(layers))
    res |= numerics(layers[:k], scale)
    if not small:
        res |= timings(sizes, scale)
    print(json.dumps(res))


if __name__ == "__main__":
    with torch.no_grad():
        main()
