"""`benchmarks/run_all.py`: a benchmark out of its budget is killed with its process group (its
children too), its record says so, and its temporary folder (where its model folders go) is
removed; a finished one's JSON line is its record's result."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import run_all

SCRIPT = """
import json, os, subprocess, sys, time
from pathlib import Path
Path(os.environ["TMPDIR"], "model.safetensors").write_bytes(b"0" * 1024)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
Path(sys.argv[1]).write_text(str(child.pid))
if sys.argv[2] == "sleep":
    time.sleep(60)
Path(sys.argv[-1]).write_text(json.dumps({"bench": "fake", "x": 1}) + "\\n")
child.kill()
"""


@pytest.mark.processes
def test_a_benchmark_out_of_time_is_killed_recorded_and_cleaned_up(tmp_path, monkeypatch):
    script = tmp_path / "fake_bench.py"
    script.write_text(textwrap.dedent(SCRIPT))
    pid = tmp_path / "child.pid"
    monkeypatch.setitem(
        run_all.BENCHMARKS, "fake", (str(script), [str(pid), "sleep"], [str(pid), "done"])
    )
    root, out = tmp_path / "root", tmp_path / "bench.jsonl"
    args = ["--only", "fake", "--root", str(root), "--out", str(out)]
    (slow,) = run_all.main([*args, "--budget", "3"])
    assert slow["status"] == "timeout" and slow["result"] is None
    assert json.loads(out.read_text()) == slow
    assert list(root.iterdir()) == []  # its folder and the file in it: gone
    child = Path("/proc", pid.read_text())
    deadline = time.monotonic() + 5
    while child.exists() and "Z" not in (child / "stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the benchmark's child outlived it"
        time.sleep(0.1)
    (done,) = run_all.main([*args, "--smoke"])
    assert done["status"] == "ok" and done["result"] == {"bench": "fake", "x": 1}
    with pytest.raises(SystemExit):
        run_all.main(["--only", "nope", "--out", str(out)])
