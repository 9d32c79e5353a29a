"""`python -m policyworker export --checkpoint DIR --out HF_DIR`: a checkpoint's weights as a
Hugging Face folder (config, safetensors, tokenizer files if the checkpoint has them).

Runs as one process (world size 1, any saved layout: dist-checkpointing reshards on load), on the
GPU when there is one. The weights keep the checkpoint's precision.
"""

from __future__ import annotations

from pathlib import Path

from policyworker.checkpoint.checkpointer import HF_SUBDIR
from policyworker.checkpoint.commit import read_manifest


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Load the weights at `checkpoint` (a `save_checkpoint` weights directory) and write them to
    `out` as a Hugging Face folder. Raises `CheckpointError` for a bad checkpoint."""
    from policyworker.config import PolicyConfig
    from policyworker.worker import MegatronPolicyWorker

    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint, "checkpoint")
    hf = checkpoint / HF_SUBDIR
    tokenizer = None
    if (hf / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    # nothing runs forward: a short max length keeps every sliding-window check satisfied
    cfg = PolicyConfig(
        model_name=str(hf), precision=manifest["precision"], max_total_sequence_length=16
    )
    worker = MegatronPolicyWorker(
        cfg,
        tokenizer=tokenizer,
        weights_path=str(checkpoint),
        init_optimizer=False,
        init_reference_model=False,
    )
    return worker.save_hf_pretrained(out)
