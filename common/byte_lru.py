"""An LRU map under a byte budget: the one mechanism behind epd's in-memory caches.

Eviction order: least recently used first, where `get` (a hit) and `put` both count as a
use. Entries are never mutated by the map; callers may keep references to evicted values.
Thread-safe (one lock per map), so a cache shared by worker threads (the router's
processed images) and one touched from an event loop only (the encoder's rows) are the same
class.

Bytes are the memory the entries keep alive. An entry owns its bytes (`nbytes`) unless it
names an `owner`: a buffer it is a view of, shared with other entries (the encoder's rows
of one batch segment). An owner's `nbytes` count once while any entry naming it is stored,
and are freed only when the last of them is evicted, so `bytes_used` is the memory held,
never less. An entry whose bytes (or whose new owner's) exceed the whole budget is not
stored. A map given `entry_bytes` also counts that much per stored entry: the Python and
torch objects an entry costs beside its payload, which for tiny payloads (one 64-wide row)
are most of its memory (`ENTRY_BYTES`, what caches that serve traffic count).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    """A value that knows the bytes it holds."""

    @property
    def nbytes(self) -> int: ...


V = TypeVar("V", bound=Sized)

# What a stored entry costs beside its payload (its key, the map's slot, the entry object
# and a tensor's): measured 0.8 to 2.4 KB for the encoder's and the router's caches.
ENTRY_BYTES = 1024


def _owner(entry: object) -> Sized:
    """What holds the entry's memory: its `owner` when it names one, else itself."""
    owner = getattr(entry, "owner", None)
    return owner if owner is not None else entry  # type: ignore[return-value]


@dataclass(slots=True)
class _Held:
    """An owner some stored entries name (kept, so its id stays its own)."""

    owner: Sized
    nbytes: int  # the owner's bytes, counted in bytes_used while entries > 0
    entries: int = 0  # stored entries naming it


class ByteBudgetLru(Generic[V]):
    """LRU map from bytes keys to `V`, bounded by `budget_bytes` of memory held.

    Counters: `hits` and `lookups` (every `get`), `evictions`, `bytes_used`.
    """

    def __init__(self, budget_bytes: int, entry_bytes: int = 0) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must not be negative, got {budget_bytes}")
        self.budget_bytes = budget_bytes  # upper bound of bytes_used
        self.entry_bytes = entry_bytes  # counted per stored entry beside its owner's bytes
        self.bytes_used = 0  # bytes of the owners the stored entries keep alive, and theirs
        self.hits = 0  # gets that found their key
        self.lookups = 0  # all gets
        self.evictions = 0  # entries dropped to make room
        self._entries: OrderedDict[bytes, V] = OrderedDict()  # LRU first
        self._owners: dict[int, _Held] = {}  # id(owner) -> the owner and its entries
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

    def get_many(self, keys: Sequence[bytes]) -> list[V | None]:
        """`get` of every key in order (hits become the most recently used, in that order),
        under one lock acquisition: an entry or None per key."""
        with self._lock:
            entries = self._entries
            found = list(map(entries.get, keys))
            misses = found.count(None)
            self.lookups += len(found)
            self.hits += len(found) - misses
            if misses != len(found):
                for key, entry in zip(keys, found, strict=True):
                    if entry is not None:
                        entries.move_to_end(key)
            return found

    def put(self, key: bytes, entry: V) -> bool:
        """Store `entry` as most recently used, evicting LRU entries to fit the budget.

        Returns False (and stores nothing) when the entry's memory alone exceeds the budget.
        """
        return self.put_many((key,), (entry,), _owner(entry))

    def put_many(self, keys: Sequence[bytes], entries: Sequence[V], owner: Sized) -> bool:
        """`put` of every (key, entry) in order, for entries that all hold their memory in
        `owner` (each names it, or is it): room for the owner is made once, not per entry.

        Returns False (and changes nothing) when the owner and these entries alone exceed the
        whole budget.
        """
        size = owner.nbytes
        each = self.entry_bytes
        with self._lock:
            stored = self._entries
            held = self._owners.get(id(owner))
            if size + each * len(keys) > self.budget_bytes and (
                size + each * len(dict.fromkeys(keys)) > self.budget_bytes
            ):
                return False  # not even alone with its owner: nothing changes
            if not stored.keys().isdisjoint(keys):  # replacing entries: drop the old ones
                for key in keys:
                    old = stored.pop(key, None)
                    if old is not None:
                        self._drop(old)
                held = self._owners.get(id(owner))
            added = len(dict.fromkeys(keys))  # none stored now
            while stored:  # room for the entries, and for the owner unless it is held
                held = self._owners.get(id(owner))  # (evicting its last entry lets it go)
                more = each * added + (0 if held is not None else size)
                if self.bytes_used + more <= self.budget_bytes:
                    break
                _, evicted = stored.popitem(last=False)
                self._drop(evicted)
                self.evictions += 1
            held = self._owners.get(id(owner))
            if held is None:
                held = self._owners[id(owner)] = _Held(owner, size)
                self.bytes_used += size
            before = len(stored)
            stored.update(zip(keys, entries, strict=True))
            held.entries += len(stored) - before  # distinct keys added
            self.bytes_used += each * (len(stored) - before)
        return True

    def _drop(self, entry: V) -> None:
        owner = _owner(entry)
        held = self._owners[id(owner)]
        held.entries -= 1
        self.bytes_used -= self.entry_bytes
        if held.entries == 0:
            del self._owners[id(owner)]
            self.bytes_used -= held.nbytes
