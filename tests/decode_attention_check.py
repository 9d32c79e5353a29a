"""Runs `ops.decode_attention`'s Triton kernel in Triton's interpreter (on the CPU, numpy) against
SDPA's masked grouped attention, one line per case; with a model folder, also a worker's
`generate` through the kernel against SDPA (one more line). Run by `test_decode_attention.py`
with TRITON_INTERPRET=1 (Triton reads it when the kernel is defined, so it needs a process of
its own). The interpreter computes bf16 dot products wrongly (it reads bf16 as integers), so bf16
is checked on the GPU (`gpu_tests/test_gpu_generation.py`); fp32 and fp16 run here.
"""

from __future__ import annotations

import sys

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch

from policyworker.model.attention.cached import masked_grouped
from policyworker.ops.decode_attention import decode_attention, splits_for

CASES = [  # dtype, rows, query heads, key heads, head dim, capacity, positions
    (torch.float32, 3, 8, 2, 64, 200, [199, 17, 0]),
    (torch.float32, 2, 5, 5, 40, 130, [64, 63]),  # no grouping, a head dim not a power of 2
    (torch.float32, 1, 12, 2, 32, 1024, [700]),  # 4 splits, the last one empty
    (torch.float32, 2, 8, 2, 64, 768, [500, 767]),  # 3 splits (a tile of 4); one row's last empty
    (torch.float16, 2, 8, 2, 64, 300, [299, 128]),
    (torch.float16, 2, 32, 2, 64, 1024, [1023, 5]),  # 16 heads per key head; splits
]


def main() -> None:
    torch.manual_seed(0)
    for dtype, b, heads, groups, dim, capacity, positions in CASES:
        q = torch.randn(b, heads, dim, dtype=dtype)
        k, v = (torch.randn(b, groups, capacity, dim, dtype=dtype) for _ in range(2))
        pos = torch.tensor(positions)
        # slots past a row's position must not count: fill them with what would show
        for row, p in enumerate(positions):
            k[row, :, p + 1 :] = 30.0
            v[row, :, p + 1 :] = float("nan")
        got = decode_attention(q, k, v, pos, dim**-0.5)
        clean_k, clean_v = k.float().clone(), v.float().clone()
        for row, p in enumerate(positions):
            clean_k[row, :, p + 1 :] = 0
            clean_v[row, :, p + 1 :] = 0
        want = masked_grouped(q[:, :, None].float(), clean_k, clean_v, pos[None, :], dim**-0.5)
        err = (got.float() - want[:, :, 0]).abs().max().item()
        splits = splits_for(b, groups, capacity, q.device)
        print(
            f"{str(dtype)[6:]} b={b} heads={heads}/{groups} dim={dim} splits={splits} err={err:.3g}"
        )


def generation(folder: str) -> None:
    """A worker's `generate` with `generation.decode_attention: triton` (the kernel on every
    decode step, here in the interpreter) against SDPA: one line with the tokens' agreement and
    the largest logprob difference, fp32."""
    from policyworker.config import PolicyConfig
    from policyworker.data.batched_data_dict import BatchedDataDict
    from policyworker.worker import MegatronPolicyWorker

    ids = torch.randint(1, 100, (4, 9), generator=torch.Generator().manual_seed(0))
    data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([9, 3, 6, 1])})
    out = {}
    for kernel in ("sdpa", "triton"):
        cfg = PolicyConfig(
            model_name=folder,
            precision="float32",
            max_total_sequence_length=32,
            generation={"max_new_tokens": 8, "stop_token_ids": [], "decode_attention": kernel},
        )
        worker = MegatronPolicyWorker(cfg, init_optimizer=False, init_reference_model=False)
        out[kernel] = worker.generate(data=data, seed=3)
        worker.shutdown()
    same = torch.equal(out["sdpa"]["output_ids"], out["triton"]["output_ids"])
    err = (out["sdpa"]["logprobs"] - out["triton"]["logprobs"]).abs().max().item()
    print(f"generate same_tokens={same} err={err:.3g}")


if __name__ == "__main__":
    main()
    if len(sys.argv) > 1:
        generation(sys.argv[1])
