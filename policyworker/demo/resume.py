"""Where a demo run continues from, decided and checked before any work starts.

A step folder `OUT/checkpoints/step_N` is complete when it holds `loop.json` (written last, after
the worker's checkpoint is committed). A run continues from `--resume` if given, else from the
latest complete step folder in its `--out` — so re-running the same command after a crash goes
on where it stopped — else it starts fresh. It never writes over a complete step folder: a
`--resume` older than the latest complete one of the same `--out` is refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policyworker.checkpoint.commit import CheckpointError, check_model, read_manifest
from policyworker.model.hf_config import ModelShape

log = logging.getLogger(__name__)

LOOP_FILE = "loop.json"


@dataclass(frozen=True, slots=True)
class ResumePoint:
    folder: Path
    """The step folder: weights/, optim/ and loop.json."""
    loop: dict[str, Any]
    """The loop's state: `step` (steps done), `rng` (the data RNG) and `rows` (metrics so far)."""


def step_folder(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step}"


def complete_steps(out: Path) -> dict[int, Path]:
    """Step -> folder of every complete step folder of the run in `out`."""
    found = {}
    for path in (out / "checkpoints").glob("step_*"):
        number = path.name.removeprefix("step_")
        if number.isdigit() and (path / LOOP_FILE).is_file():
            found[int(number)] = path
    return found


def resume_point(out: Path, resume: str | None, shape: ModelShape) -> ResumePoint | None:
    """Where the run continues from (None: a fresh run). A `ValueError` names the option."""
    done = complete_steps(out)
    if resume is not None:
        folder = Path(resume)
        field = "--resume"
    elif done:
        folder, field = done[max(done)], "--out"
        log.info("continuing from %s (the latest complete step in --out)", folder)
    else:
        return None
    loop = _read_loop(folder, field)
    later = sorted(s for s in done if s > loop["step"])
    if later:
        raise ValueError(
            f"--resume: {out} holds later complete steps {later}; resume from the latest "
            "(or leave --resume out), or write to a new --out"
        )
    try:
        weights = read_manifest(folder / "weights", field)
        check_model(weights, shape, field)
        optim = read_manifest(folder / "optim", field)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    if weights.get("save_id") != optim.get("save_id") or weights.get("step") != loop["step"]:
        raise ValueError(
            f"{field}: {folder}: its weights, optim and {LOOP_FILE} are not of one save"
        )
    return ResumePoint(folder=folder, loop=loop)


def _read_loop(folder: Path, field: str) -> dict[str, Any]:
    path = folder / LOOP_FILE
    if not path.is_file():
        raise ValueError(f"{field}: {folder} has no {LOOP_FILE} (expected OUT/checkpoints/step_N)")
    try:
        loop = json.loads(path.read_text())
        ok = (
            isinstance(loop["step"], int)
            and loop["step"] >= 0
            and isinstance(loop["rows"], list)
            and len(loop["rows"]) == loop["step"]
            and isinstance(loop["rng"], list)
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{field}: {path} does not parse ({e})") from None
    if not ok:
        raise ValueError(f"{field}: {path} is not a demo loop state (step, rng, rows)")
    return loop
