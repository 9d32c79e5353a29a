"""Named sharding: the world's ranks as a mesh `[pipeline_parallel, data_parallel,
context_parallel, tensor_parallel]`, in megatron's order (tensor parallel fastest).

    mesh = NamedSharding.from_world(8, tensor_parallel=2, pipeline_parallel=2)
    mesh.coords(5)                    # {"pipeline_parallel": 1, "data_parallel": 0, ...}
    mesh.ranks_along("tensor_parallel", 5)   # [4, 5]
    mesh.replica(1)                   # every rank holding data-parallel shard 1
    mesh.leader(1)                    # the one whose outputs the driver keeps

The driver sends data-parallel shard d to every rank of `replica(d)` and keeps `leader(d)`'s
outputs (TP, CP and PP ranks of one replica return the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel")


@dataclass(frozen=True, slots=True, kw_only=True)
class NamedSharding:
    pipeline_parallel: int = 1
    data_parallel: int = 1
    context_parallel: int = 1
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}: expected an int >= 1, got {size!r}")

    @classmethod
    def from_world(
        cls,
        world_size: int,
        *,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        context_parallel: int = 1,
    ) -> NamedSharding:
        """The mesh of `world_size` ranks; data parallel takes what the others leave."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"num_workers: expected an int >= 1, got {world_size!r}")
        sizes = {"tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel}
        for axis, size in {**sizes, "context_parallel": context_parallel}.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}: expected an int >= 1, got {size!r}")
        model = tensor_parallel * pipeline_parallel * context_parallel
        if model < 1 or world_size % model:
            raise ValueError(
                f"num_workers: expected a multiple of tensor x pipeline x context parallel = "
                f"{tensor_parallel} x {pipeline_parallel} x {context_parallel} = {model}, "
                f"got {world_size}"
            )
        return cls(
            pipeline_parallel=pipeline_parallel,
            data_parallel=world_size // model,
            context_parallel=context_parallel,
            tensor_parallel=tensor_parallel,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of `rank` along each axis."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        for axis, size in reversed(list(zip(AXES, self.shape, strict=True))):
            rank, out[axis] = divmod(rank, size)
        return {axis: out[axis] for axis in AXES}

    def rank(self, **coords: int) -> int:
        """The rank at `coords` (an axis left out is 0)."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; expected some of {AXES}")
        rank = 0
        for axis, size in zip(AXES, self.shape, strict=True):
            c = coords.get(axis, 0)
            if not 0 <= c < size:
                raise ValueError(f"{axis}: coordinate {c} outside [0, {size})")
            rank = rank * size + c
        return rank

    def ranks_along(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from `rank` only along `axis` (its group on that axis)."""
        if axis not in AXES:
            raise ValueError(f"axis: expected one of {AXES}, got {axis!r}")
        coords = self.coords(rank)
        return [self.rank(**{**coords, axis: i}) for i in range(getattr(self, axis))]

    def replica(self, dp_rank: int) -> list[int]:
        """The ranks (TP x CP x PP) that hold data-parallel shard `dp_rank`."""
        return [r for r in range(self.world_size) if self.coords(r)["data_parallel"] == dp_rank]

    def leader(self, dp_rank: int) -> int:
        """The rank whose outputs stand for replica `dp_rank`: its first."""
        return self.rank(data_parallel=dp_rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
