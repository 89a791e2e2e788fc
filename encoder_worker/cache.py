"""The encoder cache: embedding rows by content hash, LRU under a byte budget.

Keys are 32-byte content hashes — an item's hash when it is encoded whole, a partition's
hash when the item declares partitions (so a later request for some of those partitions, or
another video sharing them, hits). Values are the rows the vision tower made for that key
(main rows plus the deepstack rows of every layer).

Eviction order: least recently used first, where `get` (a hit) and `put` both count as a
use. An entry larger than the whole budget is not stored. Entries are never mutated; callers
may keep references to evicted tensors. Touched only from the server's event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class EncodedRows:
    """The tower's output for one cache key (an item or a partition)."""

    rows: torch.Tensor  # (output_rows, out_hidden) main embedding rows
    deepstack: tuple[torch.Tensor, ...]  # per deepstack layer, same shape as `rows`

    @property
    def nbytes(self) -> int:
        """Bytes held by all the tensors."""
        return sum(t.numel() * t.element_size() for t in (self.rows, *self.deepstack))


class EncoderCache:
    """LRU map from content hash to `EncodedRows`, bounded by `budget_bytes`.

    Counters: `hits` and `lookups` (every `get`), `evictions`, `bytes_used`.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must not be negative, got {budget_bytes}")
        self.budget_bytes = budget_bytes  # upper bound of bytes_used
        self.bytes_used = 0  # sum of nbytes of the stored entries
        self.hits = 0  # gets that found their key
        self.lookups = 0  # all gets
        self.evictions = 0  # entries dropped to make room
        self._entries: OrderedDict[bytes, EncodedRows] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        """Membership without counting a lookup or touching the LRU order."""
        return key in self._entries

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        return list(self._entries)

    def get(self, key: bytes) -> EncodedRows | None:
        """The entry for `key` (now the most recently used), or None; counts a lookup."""
        self.lookups += 1
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: EncodedRows) -> bool:
        """Store `entry` as most recently used, evicting LRU entries to fit the budget.

        Returns False (and stores nothing) when the entry alone exceeds the budget.
        """
        size = entry.nbytes
        if size > self.budget_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes_used -= old.nbytes
        while self._entries and self.bytes_used + size > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes_used -= evicted.nbytes
            self.evictions += 1
        self._entries[key] = entry
        self.bytes_used += size
        return True
