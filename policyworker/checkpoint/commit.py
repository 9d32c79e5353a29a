"""Crash-safe directories: write into a temporary sibling, commit by rename once every rank is done.

A directory is a complete policyworker checkpoint exactly when it holds `policyworker.json` (the
manifest, written last, inside the temporary sibling, before the rename). A process killed at any
point leaves the target either absent or complete; the temporary sibling it leaves behind starts
with a dot and holds no manifest, so nothing mistakes it for a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from policyworker.model.hf_config import ModelShape

MANIFEST = "policyworker.json"
FORMAT = "policyworker-checkpoint"
FORMAT_VERSION = 1

# Test hook: `POLICYWORKER_FAULT=<point>` kills this process (SIGKILL) when it reaches <point>.
_FAULT_ENV = "POLICYWORKER_FAULT"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or of another model; nothing was loaded."""


class CheckpointSaveError(RuntimeError):
    """A save that failed (disk full, a writer's error): nothing was committed and its temporary
    files are removed; the message names the directory and the cause."""


def fault_point(name: str) -> None:
    """Die here if the fault-injection variable names this point (crash-safety tests)."""
    if os.environ.get(_FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def from_rank0(fn: Callable[[], Any]) -> Any:
    """`fn()` run on rank 0; its (picklable) result on every rank. If it raises, every rank
    raises (the others a `RuntimeError` naming rank 0's error) instead of waiting for it."""
    box: list[Any] = [None]
    error: Exception | None = None
    if rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:
            error, box = e, [("error", f"{type(e).__name__}: {e}")]
    if distributed():
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@dataclass(frozen=True, slots=True)
class Tmp:
    """A save's temporary sibling of its target, and the folders above it that the save made
    (a failed save removes them again when they are empty)."""

    path: Path
    made: tuple[Path, ...]

    def discard(self) -> None:
        """Remove the temporary folder and, if empty, the folders made for it (rank 0)."""
        shutil.rmtree(self.path, ignore_errors=True)
        for folder in self.made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


_HOST = socket.gethostname()
_TMP = re.compile(r"^\..+\.tmp-(\d+)@(.+)-[a-z0-9_]{8}$")  # mkdtemp adds 8 characters


def make_tmp(folder: Path) -> Tmp:
    """A new temporary sibling of `folder` (rank 0 creates it; every rank gets its path),
    named after the process that writes it (`.<name>.tmp-<pid>@<host>-<random>`). The
    temporary siblings that saves killed on this host left there (their process is gone) are
    swept first."""

    def make() -> tuple[str, list[str]]:
        made = [p for p in (folder.parent, *folder.parent.parents) if not p.exists()]
        folder.parent.mkdir(parents=True, exist_ok=True)
        sweep_killed(folder.parent)
        prefix = f".{folder.name}.tmp-{os.getpid()}@{_HOST}-"
        return tempfile.mkdtemp(prefix=prefix, dir=folder.parent), [str(p) for p in made]

    path, made = from_rank0(make)
    return Tmp(Path(path), tuple(Path(p) for p in made))


def sweep_killed(parent: Path) -> None:
    """Remove the temporary folders in `parent` of saves whose process, on this host, is gone
    (killed mid-write: nothing of theirs could clean up). Another host's or a live one's stay."""
    for entry in parent.iterdir():
        found = _TMP.match(entry.name)
        if found is None or found.group(2) != _HOST or not entry.is_dir():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(found.group(1)), 0)
            continue  # alive (or another user's)
        shutil.rmtree(entry, ignore_errors=True)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest durably (rank 0 only): it is what marks the directory complete."""
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, folder: Path) -> None:
    """Rank 0: rename `tmp` into place (`folder` must not exist) and make the rename durable."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private
    os.rename(tmp, folder)
    fd = os.open(folder.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sizes(folder: Path) -> dict[str, int]:
    """Relative path -> bytes of every file under `folder` (the manifest excepted)."""
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def read_manifest(folder: Path, field: str) -> dict[str, Any]:
    """The manifest of a complete checkpoint, after checking every file it lists is there with
    its size. Raises `CheckpointError` naming `field` and what is wrong."""
    if not folder.is_dir():
        raise CheckpointError(f"{field}: {folder} is not a directory{unfinished(folder)}")
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{field}: {folder} is not a complete checkpoint (no {MANIFEST}: never committed, "
            "or not a policyworker checkpoint)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{field}: {path} does not parse ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{field}: {path} is format {manifest.get('format')!r} version "
            f"{manifest.get('format_version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}"
        )
    for name, size in manifest.get("files", {}).items():
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"{field}: {folder} is missing {name}")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{field}: {folder}/{name} has {f.stat().st_size} bytes, expected {size} "
                "(truncated or overwritten)"
            )
    return manifest


def unfinished(folder: Path) -> str:
    """A note naming the temporary folders of saves to `folder` that never committed (an
    interrupted async save, a killed process), or ""."""
    left = sorted(p.name for p in folder.parent.glob(f".{folder.name}.tmp-*"))
    if not left:
        return ""
    return (
        f" (a save to it did not finish: its temporary folder {left[0]} remains in "
        f"{folder.parent}, nothing was committed; remove it)"
    )


def is_checkpoint(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


# Fields of the model's shape that must agree between a checkpoint and the model it loads into.
_SHAPE_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


def model_fields(shape: ModelShape) -> dict[str, Any]:
    """What a manifest records of the model (a `ModelShape`'s defining fields)."""
    return {k: getattr(shape, k) for k in _SHAPE_FIELDS}


def check_model(manifest: dict[str, Any], shape: ModelShape, field: str) -> None:
    """Refuse a checkpoint of another model shape, naming the first field that differs."""
    saved = manifest.get("model", {})
    for key, value in model_fields(shape).items():
        if saved.get(key) != value:
            raise CheckpointError(
                f"{field}: the checkpoint is of a model with {key}={saved.get(key)!r}; "
                f"this model has {key}={value!r}"
            )
