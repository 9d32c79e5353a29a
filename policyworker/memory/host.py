"""Host buffers for offloaded training state: one exact-size allocation, pinned on a GPU machine.

torch's pinned allocator rounds every request up to a power of two (a 19 GB request takes 32 GB
of page-locked memory), which is how offloading doubles host memory in peer systems. A
`HostArena` allocates ordinary host memory of the exact size and page-locks it with
`cudaHostRegister` instead; each offloaded storage has a fixed slot in it. The arena is allocated
once for a set of storage sizes and reused by every later offload of the same set.
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)

ALIGN = 512  # bytes; slot offsets stay aligned for vectorized copies


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HostArena:
    """A host byte buffer with one slot per storage size, pinned when CUDA is present."""

    def __init__(self, sizes: list[int], *, pin: bool, prefault: bool = True) -> None:
        self.sizes = list(sizes)
        self.offsets: list[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += _round_up(n, ALIGN)
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self._bytes: memoryview | None = None
        if pin and prefault:
            self.buffer.zero_()  # fault the pages in on all cores; registering then only locks
        self.pinned = pin and total > 0 and _register(self.buffer)
        if self.pinned:  # unregistered before the buffer itself is freed
            weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, self.buffer.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def fits(self, sizes: list[int]) -> bool:
        return sizes == self.sizes

    def slot(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i] : self.offsets[i] + self.sizes[i]]

    def tensor(self, i: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """Slot `i` as a tensor whose storage is exactly the slot, not a view of the whole
        buffer: code that clones views of larger storages (megatron's checkpoint writer does)
        then takes it as it is."""
        count = shape.numel()
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        if self._bytes is None:
            self._bytes = memoryview(self.buffer.numpy())
        flat = torch.frombuffer(self._bytes, dtype=dtype, count=count, offset=self.offsets[i])
        return flat.view(shape)


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer`; False (and pageable copies) when the driver refuses."""
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if err != 0:
        log.warning("cudaHostRegister of %d bytes failed (error %d)", buffer.numel(), err)
        return False
    return True
