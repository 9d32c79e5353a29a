"""A user's run shows our lines, not the notices megatron-core and torch print on every start;
`POLICYWORKER_VERBOSE=1` shows them again."""

import subprocess
import sys

import pytest
from helpers import clean_env

SCRIPT = """
from policyworker.logs import quiet_third_party
quiet_third_party()
import megatron.core.optimizer, megatron.core.models.gpt.gpt_model  # noqa: F401
"""

pytestmark = pytest.mark.processes


def _stderr(verbose: str) -> str:
    env = {**clean_env(), "POLICYWORKER_VERBOSE": verbose}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_known_notices_are_filtered_unless_verbose():
    quiet, loud = _stderr("0"), _stderr("1")
    assert "Transformer Engine and Apex are not installed" in loud
    assert "Transformer Engine" not in quiet and "absl" not in quiet
