"""A user's run shows our lines, not the notices megatron-core and torch print on every start;
`POLICYWORKER_VERBOSE=1` shows them again."""

import subprocess
import sys

import pytest
from helpers import clean_env, make_hf_model

# A user's own script (as under torchrun): it builds a worker and calls nothing of logs.py.
SCRIPT = """
import sys
from policyworker import MegatronPolicyWorker, PolicyConfig
worker = MegatronPolicyWorker(PolicyConfig(model_name=sys.argv[1], precision="float32"))
print("built", file=sys.stderr)
"""

pytestmark = pytest.mark.processes


def _stderr(model: str, verbose: str) -> str:
    env = {**clean_env(), "POLICYWORKER_VERBOSE": verbose}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, model], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_known_notices_are_filtered_unless_verbose(tmp_path):
    model = str(make_hf_model(tmp_path, "qwen3_moe"))
    quiet, loud = _stderr(model, "0"), _stderr(model, "1")
    assert "Transformer Engine and Apex are not installed" in loud and "IS DEPRECATED" in loud
    assert quiet.strip() == "built", quiet
