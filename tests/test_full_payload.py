"""The seed's `get_logprobs_with_full_payload` (#29, the teacher's side of full-vocabulary
distillation): sampled-token logprobs and the whole payload from one forward."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_worker
from helpers import make_batch

from policyworker.config import SequencePackingConfig

PAYLOAD = "teacher_full_payload"


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_payloads_equal_transformers_and_logprobs_equal_get_logprobs(llama_dir, packed):
    """fp32: the hidden-state payload is transformers' last hidden state (after the final
    norm), the logits payload its logits (no temperature), each 0 past a row's length, on CPU
    in the asked dtype; the logprobs are get_logprobs' (packed and chunked alike)."""
    data = make_batch(batch=4, seq=12)
    packing = SequencePackingConfig(enabled=packed, logprob_mb_tokens=20)
    worker = make_worker(llama_dir, sequence_packing=packing, logprob_chunk_size=5, temperature=0.7)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        out = hf(input_ids=data["input_ids"], output_hidden_states=True)
    valid = torch.arange(12)[None, :] < data["input_lengths"][:, None]
    want = {"hidden_states": out.hidden_states[-1], "logits": out.logits}
    for kind, ref in want.items():
        got = worker.get_logprobs_with_full_payload(
            data=data, payload=kind, payload_dtype="float32", micro_batch_size=2
        )
        full = got[PAYLOAD]
        assert full.device.type == "cpu" and full.dtype == torch.float32
        assert full.shape == (*data["input_ids"].shape, ref.shape[-1])
        assert (full[valid] - ref[valid]).abs().max().item() <= 1e-4
        assert (full[~valid] == 0).all()
        assert torch.equal(got["logprobs"], worker.get_logprobs(data=data)["logprobs"])
    half = worker.get_logprobs_with_full_payload(
        data=data, payload="logits", payload_dtype="bfloat16"
    )
    assert half[PAYLOAD].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(payload="probs", payload_dtype="float32"), "payload"),
        (dict(payload="logits", payload_dtype="int8"), "payload_dtype"),
    ],
)
def test_bad_arguments_are_refused(llama_dir, kw, match):
    worker = make_worker(llama_dir)
    with pytest.raises(ValueError, match=match):
        worker.get_logprobs_with_full_payload(data=make_batch(batch=2, seq=6), **kw)
