"""Which directories a save may write and a new worker reads, checked before any work."""

from __future__ import annotations

from pathlib import Path

from policyworker.checkpoint.commit import CheckpointError, is_checkpoint, unfinished


def checkpoint_kind(path: Path, field: str) -> str:
    """ "checkpoint" (ours, complete), "hf" (config.json + safetensors) or a `CheckpointError`."""
    if is_checkpoint(path):
        return "checkpoint"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors*")):
        return "hf"
    if path.is_dir() and any(path.glob(".metadata")):
        raise CheckpointError(f"{field}: {path} is an incomplete checkpoint (no manifest)")
    raise CheckpointError(
        f"{field}: {path} is neither a policyworker checkpoint nor a Hugging Face folder"
        f"{unfinished(path)}"
    )


def check_save_paths(
    weights_path: str | Path,
    optimizer_path: str | Path | None,
    has_optimizer: bool,
    *,
    pending: list[Path],
) -> tuple[Path, Path | None]:
    """Validate `save_checkpoint`'s directories before anything is staged or written: new,
    apart, not inside a committed checkpoint, not the target of the pending async save."""
    paths: list[Path | None] = []
    for name, value in (("weights_path", weights_path), ("optimizer_path", optimizer_path)):
        if value is None and name == "optimizer_path":
            paths.append(None)
            continue
        if not isinstance(value, str | Path) or not str(value):
            raise ValueError(f"{name}: expected a directory path, got {value!r}")
        path = Path(value).absolute()
        if path.exists():
            raise ValueError(
                f"{name}: {path} exists; a checkpoint is never written over (choose a new "
                "directory, e.g. one per step, or remove the old one)"
            )
        if path in pending:
            raise ValueError(
                f"{name}: the async save to {path} is still pending; finalize_async_save() "
                "first, or choose a new directory"
            )
        inside = next((p for p in path.parents if is_checkpoint(p) or p in pending), None)
        if inside is not None:
            raise ValueError(f"{name}: {path} is inside the checkpoint directory {inside}")
        paths.append(path)
    weights, optimizer = paths
    assert weights is not None
    if optimizer is not None:
        if not has_optimizer:
            raise ValueError("optimizer_path: this worker has no optimizer (init_optimizer=False)")
        if optimizer == weights or weights in optimizer.parents or optimizer in weights.parents:
            raise ValueError(
                f"optimizer_path: expected a directory apart from weights_path, got {optimizer}"
            )
    return weights, optimizer


def initial_weights(
    model_name: str, weights_path: str | None, optimizer_path: str | None, *, init_optimizer: bool
) -> tuple[str | None, Path | None]:
    """Where a new worker's weights come from: (HF folder to read, checkpoint to load after).

    A checkpoint's worker still reads `model_name`'s HF weights when it has them: they are the
    reference model's (the policy the run started from), the checkpoint then replaces the live
    weights."""
    if weights_path is None:
        if optimizer_path is not None:
            raise ValueError("optimizer_path: needs weights_path (the checkpoint it belongs to)")
        return model_name, None
    kind = checkpoint_kind(Path(weights_path), "weights_path")
    if kind == "hf":
        if optimizer_path is not None:
            raise ValueError(
                "optimizer_path: weights_path is a Hugging Face folder, which has no training "
                "state to pair with; pass a policyworker checkpoint"
            )
        return weights_path, None
    if optimizer_path is not None and not init_optimizer:
        raise ValueError("optimizer_path: init_optimizer=False, so there is no optimizer to load")
    has_hf = any(Path(model_name).glob("*.safetensors*"))
    return (model_name if has_hf else None), Path(weights_path)
