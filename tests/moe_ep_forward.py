"""megatron-core's MoE layer under expert parallelism on gloo, below the worker (which refuses
EP > 1 until its export, refit and gradient norm know expert groups): each rank loads its half of
the experts of a HF checkpoint and runs a forward; rank 0 writes the max |Δ logit| against
transformers to OUT.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/moe_ep_forward.py MODEL OUT
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from policyworker.compat.cpu import apply_cpu_patches
from policyworker.config import ParallelConfig
from policyworker.model.build import build_gpt_model
from policyworker.model.hf_config import load_hf_config, model_shape
from policyworker.model.weights import SafetensorsReader, mappings
from policyworker.parallel.dims import destroy_parallel, setup_parallel


def main(folder: str, out: str) -> None:
    apply_cpu_patches()
    dims, _ = setup_parallel(ParallelConfig(expert_model_parallel_size=2))
    ep_rank = dist.get_rank()  # EP2 on two ranks: the expert-parallel rank is the rank
    hf_config = load_hf_config(folder)
    shape = model_shape(hf_config)
    model = build_gpt_model(hf_config, shape, dims=dims, params_dtype=torch.float32, max_seq_len=64)
    params = dict(model.named_parameters())
    assert shape.moe is not None
    local = shape.moe.num_experts // 2
    reader = SafetensorsReader(folder)
    with torch.no_grad():
        for m in mappings(shape):
            name, found = m.mcore, re.search(r"local_experts\.(\d+)\.", m.mcore)
            if found:  # the global expert, as this rank's local one (or another rank's)
                e = int(found[1]) - ep_rank * local
                if not 0 <= e < local:
                    continue
                name = name.replace(found[0], f"local_experts.{e}.")
            params.pop(name).copy_(m.to_mcore([reader.get(n) for n in m.hf], shape))
    assert not params, sorted(params)  # every parameter loaded
    ids = torch.randint(0, shape.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.eval()(ids, torch.arange(12)[None].expand(2, -1), None)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        Path(out).write_text(str((logits - ref).abs().max().item()))
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
