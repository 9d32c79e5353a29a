#!/usr/bin/env bash
# The demo's --model/--data path on a GPU, bf16: a small checkpoint with the char tokenizer.
set -euo pipefail
work=$(mktemp -d)
python3 - "$work" <<'PY'
import json, sys
from pathlib import Path
from policyworker.demo.grpo import tiny_llama
from policyworker.demo.task import char_tokenizer
work = Path(sys.argv[1])
tok = char_tokenizer()
ckpt = tiny_llama(work / "ckpt", len(tok), seed=0)
tok.save_pretrained(ckpt)
rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
(work / "tasks.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
PY
python3 -m policyworker demo --model "$work/ckpt" --data "$work/tasks.jsonl" --out "${OUT:-$work}/demo_gpu" \
  precision=bfloat16 sft_steps=300 grpo_steps=20 sft_wrong_fraction=0.0
