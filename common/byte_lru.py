"""An LRU map under a byte budget: the one mechanism behind epd's in-memory caches.

Eviction order: least recently used first, where `get` (a hit) and `put` both count as a
use. An entry larger than the whole budget is not stored. Entries are never mutated by the
map; callers may keep references to evicted values. Thread-safe (one lock per map), so a
cache shared by worker threads (the router's processed images) and one touched from an
event loop only (the encoder's rows) are the same class.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    """A value that knows the bytes it holds."""

    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=Sized)


class ByteBudgetLru(Generic[V]):
    """LRU map from bytes keys to `V`, bounded by `budget_bytes` of `V.nbytes`.

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
        self._entries: OrderedDict[bytes, V] = OrderedDict()  # LRU first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        """Membership without counting a lookup or touching the LRU order."""
        with self._lock:
            return key in self._entries

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: bytes) -> V | None:
        """The entry for `key` (now the most recently used), or None; counts a lookup."""
        with self._lock:
            self.lookups += 1
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                self._entries.move_to_end(key)
            return entry

    def put(self, key: bytes, entry: V) -> bool:
        """Store `entry` as most recently used, evicting LRU entries to fit the budget.

        Returns False (and stores nothing) when the entry alone exceeds the budget.
        """
        size = entry.nbytes
        if size > self.budget_bytes:
            return False
        with self._lock:
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
