"""The encoder cache: embedding rows by content hash, LRU under a byte budget.

Keys are 32-byte content hashes — an item's hash when it is encoded whole, a partition's
hash when the item declares partitions (so a later request for some of those partitions, or
another video sharing them, hits). Values are the rows the vision tower made for that key
(main rows plus the deepstack rows of every layer).

Eviction order (`common.byte_lru`): least recently used first, where `get` (a hit) and
`put` both count as a use. An entry larger than the whole budget is not stored. The units
encoded in one batch share copied segments of the tower's output (one copy per segment of at
most about `encoder_worker.batch.SEGMENT_BYTES`, not per unit or per request, so a cached
unit keeps at most that much of other units' rows alive, and the batch output itself is
never pinned): the cache counts a segment's bytes while any of its units is stored, so
`bytes_used` is the memory held.
Entries are never mutated; callers may keep references to evicted tensors. Touched only from
the server's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.byte_lru import ByteBudgetLru


@dataclass(slots=True, eq=False)
class EncodedRows:
    """The tower's output for one cache key (an item or a partition), or for a segment of
    a batch whose units' entries are views of it (their `owner`).

    One tensor holds the main rows and every deepstack layer's (they have the same shape),
    so slicing, copying and joining an output is one tensor operation, not one per layer.
    Never mutated once made (not frozen only because a frozen dataclass costs twice as much
    to build, and the engine builds one per encoded unit).
    """

    # (1 + deepstack layers, output_rows, out_hidden): the main rows, then each layer's
    stacked: torch.Tensor
    # The segment `stacked` is a view of (None: it owns its memory); the cache counts the
    # segment's bytes once while any of its units is stored (`common.byte_lru`).
    owner: EncodedRows | None = None
    # With an owner: `stacked` is rows [start, stop) of `owner.stacked`, so units adjacent
    # in one segment are joined by one view instead of a copy (unused without an owner).
    start: int = 0
    stop: int = 0

    @classmethod
    def of(cls, rows: torch.Tensor, deepstack: Sequence[torch.Tensor]) -> EncodedRows:
        """Rows and deepstack layers (each `(output_rows, out_hidden)`) stacked (a copy)."""
        return cls(torch.stack([rows, *deepstack]))

    @property
    def rows(self) -> torch.Tensor:
        """`(output_rows, out_hidden)` main embedding rows."""
        return self.stacked[0]

    @property
    def deepstack(self) -> tuple[torch.Tensor, ...]:
        """Per deepstack layer, rows of the same shape as `rows`."""
        return tuple(self.stacked[1:].unbind(0))

    @property
    def nbytes(self) -> int:
        """Bytes of the rows (main and deepstack); of a view with no owner, of all the memory
        it keeps alive (its base's storage)."""
        if self.owner is None:
            return max(self.stacked.untyped_storage().nbytes(), self.stacked.nbytes)
        return self.stacked.numel() * self.stacked.element_size()


class EncoderCache(ByteBudgetLru[EncodedRows]):
    """LRU map from content hash to `EncodedRows`, bounded by `budget_bytes`
    (`common.byte_lru.ByteBudgetLru`).

    Counters: `hits` and `lookups` (every `get`), `evictions`, `bytes_used`.
    """
