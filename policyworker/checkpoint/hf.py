"""Write a Hugging Face folder (config + safetensors [+ tokenizer]) that transformers loads.

Every rank calls `save_hf_folder` with its tensors (a pipeline stage's share of the model); the
ranks marked `writer` (one per stage) write theirs, and rank 0 adds the index, config and
tokenizer. The folder is assembled in a temporary sibling and renamed into place, so a crash leaves
either the old folder or the new one, never a half-written checkpoint; an error on any rank is
raised on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from policyworker.checkpoint.commit import (
    CheckpointSaveError,
    from_rank0,
    gather,
    make_tmp,
    rank,
)

SHARD_BYTES = 4 * 2**30

# hf tensor name -> (file it was written to, bytes)
WeightMap = dict[str, tuple[str, int]]


def save_hf_folder(
    folder: str | Path,
    *,
    hf_config: Any,
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer: Any | None = None,
    writer: bool = True,
    part: int = 0,
) -> Path:
    """Write `tensors` as safetensors beside `config.json`; collective over all ranks.

    Non-writers still consume `tensors` (producing them may be collective, e.g. TP gathers).
    `part` (the pipeline stage) keeps the writers' file names apart.
    """
    folder = Path(folder)
    temporary = make_tmp(folder)
    tmp = temporary.path
    error: Exception | None = None
    written: WeightMap = {}
    try:
        written = _write_shards(tmp, tensors, prefix=f".part{part:05d}", write=writer)
    except Exception as e:  # reported to every rank below, then raised
        error = e
    reports = gather([written, None if error is None else f"rank {rank()}: {error!r}"])

    def finish() -> str | None:
        failures = [r[1] for r in reports if r[1] is not None]
        try:
            if not failures:
                _finish(tmp, folder, [r[0] for r in reports], hf_config, tokenizer)
        except Exception as e:
            failures.append(f"rank 0: {e!r}")
        if failures:
            free = shutil.disk_usage(tmp).free
            temporary.discard()
            full = free < (1 << 20) or "No space left" in "".join(failures)
            return (
                f"no space left on device under {folder.parent} ({free} bytes free)"
                if full
                else "; ".join(failures)
            )
        return None

    failure = from_rank0(finish)
    if failure is not None:  # a writer's own error (a full disk: safetensors' raw error) named
        raise CheckpointSaveError(
            f"saving {folder} failed: {failure}; nothing was written there and the temporary "
            "files are removed"
        ) from error
    if error is not None:
        raise error
    return folder


def _write_shards(
    folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], *, prefix: str, write: bool
) -> WeightMap:
    """Files of at most ~SHARD_BYTES named `{prefix}-{i}.safetensors` (renamed by `_finish`)."""
    written: WeightMap = {}
    shard: dict[str, torch.Tensor] = {}
    size = count = 0

    def flush() -> None:
        nonlocal shard, size, count
        fname = f"{prefix}-{count:05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        written.update({n: (fname, t.numel() * t.element_size()) for n, t in shard.items()})
        shard, size, count = {}, 0, count + 1

    for name, t in tensors:
        if not write:
            continue
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            flush()
        shard[name] = t.detach().to("cpu").contiguous()
        size += nbytes
    if shard:
        flush()
    return written


def _finish(
    tmp: Path, folder: Path, maps: list[WeightMap], hf_config: Any, tokenizer: Any | None
) -> None:
    """Rank 0: HF file names and index, config, tokenizer; then move the folder into place."""
    weight_map: dict[str, str] = {}
    for m in maps:
        for name, (fname, _) in m.items():
            if name in weight_map:
                raise ValueError(f"tensor {name!r} written twice")
            weight_map[name] = fname
    files = sorted(set(weight_map.values()))  # part, then shard order
    if len(files) == 1:
        final = {files[0]: "model.safetensors"}
    else:
        final = {
            f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)
        }
    for old, new in final.items():
        os.replace(tmp / old, tmp / new)
    if len(files) > 1:
        total = sum(nbytes for m in maps for _, nbytes in m.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: final[f] for n, f in sorted(weight_map.items())},
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _into_place(tmp, folder)


def _into_place(tmp: Path, folder: Path) -> None:
    """The finished temporary folder becomes `folder` (an old one replaced)."""
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)


def save_peft_folder(
    folder: str | Path, *, tensors: dict[str, torch.Tensor], adapter_config: dict[str, Any]
) -> Path:
    """A PEFT adapter folder (`adapter_model.safetensors`, `adapter_config.json`) that `peft`
    loads onto the base model; collective, rank 0 writes (every rank holds the same adapters),
    assembled in a temporary sibling and renamed into place as `save_hf_folder` does."""
    folder = Path(folder)
    temporary = make_tmp(folder)

    def write() -> str | None:
        try:
            weights = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
            tmp = temporary.path
            save_file(weights, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
            _into_place(tmp, folder)
        except Exception as e:
            temporary.discard()
            return repr(e)
        return None

    failure = from_rank0(write)
    if failure is not None:
        raise CheckpointSaveError(
            f"saving {folder} failed: {failure}; nothing was written there and the temporary "
            "files are removed"
        )
    return folder
