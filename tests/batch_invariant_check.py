"""`batch_invariant` end to end in Triton's interpreter (fp32, the CPU): a worker generates from
prompts of different lengths, then scores its own output with `get_logprobs`, padded and packed;
with `batch_invariant` the two agree bitwise (without it, padded, some tokens differ), and both
equal transformers'. One JSON line; run by `test_batch_invariant.py` with TRITON_INTERPRET=1 and
the model's folder as the argument."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import interpreter  # noqa: F401  (first: Triton in its interpreter)
import torch
from helpers import hf_logprobs

from policyworker.config import PolicyConfig
from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.worker import MegatronPolicyWorker

LENGTHS = [5, 3, 9]


def prompts() -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 101, (len(LENGTHS), max(LENGTHS)), generator=g)
    for row, n in enumerate(LENGTHS):
        ids[row, n:] = 0
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor(LENGTHS)})


def run(folder: str, invariant: bool, packed: bool) -> dict[str, float]:
    """Generate, then score the output: how many response tokens' logprobs differ."""
    worker = MegatronPolicyWorker(
        PolicyConfig(
            model_name=folder,
            precision="float32",
            train_global_batch_size=4,
            train_micro_batch_size=2,
            logprob_batch_size=2,
            max_total_sequence_length=40,
            temperature=0.8,
            batch_invariant=invariant,
            sequence_packing={"enabled": packed},
            generation={"max_new_tokens": 7},
        )
    )
    gen = worker.generate(data=prompts(), seed=1)
    seqs = BatchedDataDict(
        {"input_ids": gen["output_ids"], "input_lengths": gen["unpadded_sequence_lengths"]}
    )
    scored = worker.get_logprobs(data=seqs)["logprobs"]
    worker.shutdown()
    pos = torch.arange(gen["output_ids"].shape[1])[None, :]
    mask = (pos >= torch.tensor(LENGTHS)[:, None]) & (
        pos < gen["unpadded_sequence_lengths"][:, None]
    )
    diff = (scored - gen["logprobs"])[mask]
    hf = hf_logprobs(Path(folder), seqs, temperature=0.8)
    return {
        "tokens": int(mask.sum()),
        "differing": int((diff != 0).sum()),
        "max_abs": float(diff.abs().max()),
        "vs_transformers": float((scored - hf)[mask].abs().max()),
    }


def main(folder: str) -> None:
    # without the setting, padded scoring alone shows that the two paths round differently
    out = {
        "invariant": run(folder, invariant=True, packed=False),
        "invariant_packed": run(folder, invariant=True, packed=True),
        "default": run(folder, invariant=False, packed=False),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
