"""The encoder's output arena: one buffer registered with NIXL once, lent out in byte ranges.

Large outputs are copied into ranges of the arena rather than into buffers registered one
by one, so the encoder's NIXL metadata is the same snapshot for as long as it serves: every
handle carries the same bytes, and a reader loads them once (`encoder_worker.leases`).

`RangeAllocator` is the bookkeeping alone (offsets, no memory): first fit over a free list
kept sorted by offset, every range a multiple of the alignment, a freed range merged with
free neighbours at once, so freeing everything leaves one free range, the whole capacity.
`OutputArena` is the buffer and its allocator. Neither is thread-safe: the encoder calls
them on its event loop.
"""

from __future__ import annotations

import bisect
from typing import Final

import torch

ALIGN: Final = 64  # byte alignment of every range (and so of each tensor placed in one)


class RangeAllocator:
    """First-fit, coalescing allocator of aligned byte ranges in `[0, capacity)`."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        """`capacity` is rounded down to a multiple of `align` (a power of two)."""
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.align = align  # every offset and length is a multiple of this
        self.capacity = capacity - capacity % align  # bytes managed
        # Free ranges as sorted, disjoint, non-adjacent (start, end) pairs.
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._used: dict[int, int] = {}  # offset of each live range -> its (aligned) length

    def __len__(self) -> int:
        """Live ranges."""
        return len(self._used)

    @property
    def used_bytes(self) -> int:
        """Bytes in live ranges (aligned lengths)."""
        return self.capacity - self.free_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes in free ranges."""
        return sum(end - start for start, end in self._free)

    @property
    def largest_free(self) -> int:
        """The largest range `allocate` can give now."""
        return max((end - start for start, end in self._free), default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as (start, end), by offset (tests, logs)."""
        return list(self._free)

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a fresh range of at least `nbytes` (rounded up to the alignment),
        the lowest that fits; None when no free range is large enough."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        size = -(-nbytes // self.align) * self.align
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, end)
                self._used[start] = size
                return start
        return None

    def free(self, offset: int) -> None:
        """Return the range at `offset` (from `allocate`), merging it with free neighbours.

        Raises ValueError for an offset that is not a live range (a double free).
        """
        size = self._used.pop(offset, None)
        if size is None:
            raise ValueError(f"no live range at offset {offset}")
        start, end = offset, offset + size
        i = bisect.bisect_left(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:  # the next free range touches
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # so does the previous one
            i -= 1
            start = self._free.pop(i)[0]
        self._free.insert(i, (start, end))


class OutputArena:
    """A flat uint8 buffer on the encoder's device and the allocator of its ranges.

    The owner registers `buffer` with its transfer agent once; ranges are views of it.
    """

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        self.allocator = RangeAllocator(nbytes)  # which bytes of `buffer` are lent out
        self.buffer = torch.empty(self.allocator.capacity, dtype=torch.uint8, device=device)

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a fresh range of at least `nbytes`; None when none is free."""
        return self.allocator.allocate(nbytes)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """`nbytes` of the buffer from `offset`, as a flat uint8 tensor."""
        return self.buffer[offset : offset + nbytes]

    def free(self, offset: int) -> None:
        """Return the range at `offset` to the arena."""
        self.allocator.free(offset)
