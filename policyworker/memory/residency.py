"""Where a worker's training state lives, and moving it there whole.

Three groups: the parameters (and module buffers), the gradients (megatron DDP's contiguous fp32
grad buffers), and the optimizer (fp32 master weights and Adam's moments). A group moves as
storages: each storage is copied into its slot of a host arena and then resized to zero bytes,
which frees its device memory while every tensor viewing it (a parameter, `main_grad`, a bucket)
stays valid; moving back resizes it and copies the bytes in. Round trips are exact, the tensors
keep their identity, and nothing else needs rewiring.

Gradients can also be freed (not copied): outside an open train step they count as zero (stale
values that the next step's first gradients overwrite, `train.grads`), so freeing them loses
nothing and bringing them back is a zero fill.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from policyworker.memory.host import HostArena


class Where(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    FREED = "freed"
    """Gradients only: released without a copy (outside a step they count as zero: stale
    values a step's first gradients overwrite, `train.grads`); they return zero-filled."""

    @classmethod
    def of_device(cls, device: str) -> Where:
        """A user's device name: "cpu" is the host, "cuda" the worker's device."""
        targets = {"cpu": cls.HOST, "cuda": cls.DEVICE}
        if device not in targets:
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        return targets[device]


GROUPS = ("params", "grads", "optimizer")


class PhaseError(ValueError):
    """A call that needs state the current memory phase has moved off the device."""


@dataclass(slots=True)
class _Group:
    tensors: Callable[[], Iterable[torch.Tensor]]
    where: Where = Where.DEVICE
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    arena: HostArena | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


class Residency:
    """The placement of one worker's params, grads and optimizer state; `place` moves them."""

    def __init__(
        self,
        *,
        params: Callable[[], Iterable[torch.Tensor]],
        grads: Callable[[], Iterable[torch.Tensor]],
        optimizer: Callable[[], Iterable[torch.Tensor]],
        device: torch.device,
        before_params_move: Callable[[], None] | None = None,
    ) -> None:
        """`before_params_move`: run before the params leave or come back (collective, as
        every move is: e.g. complete a pending all-gather, so whole parameters move)."""
        self.device = device
        self._before_params_move = before_params_move
        self._groups = {
            "params": _Group(params),
            "grads": _Group(grads),
            "optimizer": _Group(optimizer),
        }
        self._pin = device.type == "cuda"

    def where(self) -> dict[str, Where]:
        return {name: g.where for name, g in self._groups.items()}

    def bytes_by_place(self) -> dict[Where, int]:
        """Bytes of training state per place (as of the last move of each group)."""
        self._refresh()
        out = dict.fromkeys(Where, 0)
        for g in self._groups.values():
            out[g.where] += g.nbytes
        return out

    def host_buffer_bytes(self) -> int:
        return sum(g.arena.nbytes for g in self._groups.values() if g.arena is not None)

    def require(self, call: str, *names: str) -> None:
        """Raise `PhaseError` unless every named group is on the device."""
        away = [n for n in names if self._groups[n].where is not Where.DEVICE]
        if away:
            if {"optimizer", "grads"} & set(names):  # only these phases bring them back
                fix = (
                    "prepare_for_training() (or prepare_for_lp_inference(keep_train_buffers=True))"
                )
            else:
                fix = "prepare_for_lp_inference() or prepare_for_training()"
            raise PhaseError(
                f"{call}: the {' and '.join(away)} are not on the device (memory phase "
                f"{self.where()}); call {fix} first"
            )

    def place(self, targets: dict[str, Where]) -> None:
        """Move each named group to its target: everything leaving the device first (so the
        peak never holds both), then everything coming back; one synchronization at the end."""
        moves = targets.get("params", self._groups["params"].where) != self._groups["params"].where
        if moves and self._before_params_move is not None:
            self._before_params_move()
        self._refresh()
        for name, target in targets.items():
            if target is not Where.DEVICE:
                self._leave(self._groups[name], target)
        for name, target in targets.items():
            if target is Where.DEVICE:
                self._arrive(self._groups[name])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def place_model(self, where: Where, *, params: bool, grads: bool, step_open: bool) -> None:
        """Params and/or gradients to `where`; idle gradients (no open step) leaving the device
        are freed, not copied."""
        targets = {"params": where} if params else {}
        if grads:
            targets["grads"] = Where.FREED if where is Where.HOST and not step_open else where
        self.place(targets)

    def _refresh(self) -> None:
        """Re-collect the storages of the groups on the device (optimizer state appears after the
        first step); a storage belongs to the first group that holds it (fp32 masters that view
        the parameter buffer move with the parameters)."""
        claimed: set[int] = set()
        for g in self._groups.values():
            if g.where is Where.DEVICE:
                g.storages = _distinct_storages(g.tensors(), claimed)
                g.sizes = [s.nbytes() for s in g.storages]
            claimed.update(s._cdata for s in g.storages)

    def _leave(self, g: _Group, target: Where) -> None:
        if g.where is not Where.DEVICE:
            if target is Where.FREED:  # host copy of idle gradients, or already freed
                g.where = Where.FREED
            return
        if target is Where.HOST:
            if g.arena is None or not g.arena.fits(g.sizes):
                g.arena = None  # drop the old one first: never two arenas of one group
                g.arena = HostArena(g.sizes, pin=self._pin)
            for i, storage in enumerate(g.storages):
                g.arena.slot(i).copy_(_bytes_of(storage), non_blocking=True)
        for storage in g.storages:
            storage.resize_(0)
        g.where = target

    def _arrive(self, g: _Group) -> None:
        if g.where is Where.DEVICE:
            return
        for i, (storage, size) in enumerate(zip(g.storages, g.sizes, strict=True)):
            storage.resize_(size)
            view = _bytes_of(storage)
            if g.where is Where.HOST:
                assert g.arena is not None
                view.copy_(g.arena.slot(i), non_blocking=True)
            else:
                view.zero_()
        g.where = Where.DEVICE


def _distinct_storages(
    tensors: Iterable[torch.Tensor], claimed: set[int]
) -> list[torch.UntypedStorage]:
    """Each non-empty storage once, skipping `claimed` ones; keyed by the storage's identity
    (`_cdata`, stable across `resize_`, unlike the data pointer)."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in claimed and key not in out and storage.nbytes() > 0:
            out[key] = storage
    return list(out.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
