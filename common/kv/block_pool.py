"""Block pool: which KV blocks are free, who holds them, and which hold a cached prefix.

Every block id `0 .. num_blocks - 1` is in exactly one of three states:

- **used**: reference count >= 1. Held by one or more sequences (or a transfer lease);
  may also be cached (its hash recorded) so other sequences can share it.
- **evictable**: reference count 0 and cached. Its bytes are still valid and a prefix hit
  can revive it (`acquire`); `allocate` may evict it.
- **free**: reference count 0 and not cached. Its bytes mean nothing.

Allocation order (pick-one, documented and tested): `allocate` takes **free blocks first**
(FIFO: a fresh pool hands out 0, 1, 2, ...; a released uncached block goes to the tail), and
only when none is left evicts **evictable blocks from the head of the LRU queue**. A cached
block whose count drops to 0 is appended to the queue's **tail**, so the least recently
released cached block is evicted first. `acquire` of an evictable block takes it out of the
queue; its next release puts it at the tail again.

`release(block_ids)` takes a sequence's blocks in sequence order and releases them **last to
first**, so a sequence's tail blocks enter the queue before its head blocks and are evicted
before them: the shared prefix (system prompt, first image) outlives the unique tail. As a
block is only ever acquired with every block before it, no cached block outlives the
blocks before it in any sequence (only `uncache_block` can leave such a hole): what a
worker caches of a prompt is a prefix of it, which lets a router find each worker's
cached prefix by binary search.

Ownership: whoever gets a block from `allocate` or `acquire` owns one reference and must
`release` it exactly once (the request's scheduler, or the prefill lease holder). The pool
never frees a referenced block. `find_cached_prefix`, `find_cached` and `get` take no
reference: call `acquire` on their result before anything else can allocate.

KV events ("stored" on a new cache entry, "removed" on eviction, "cleared" on reset) are
queued for `drain_events` when `record_events` is set (the owner must then drain them, or
the queue grows) and passed to `on_event` when given.

Not thread-safe: callers serialize every call (one event loop or one lock per pool).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

KvEventKind = Literal["stored", "removed", "cleared"]


# Opens the details of a worker's RESOURCE_EXHAUSTED for its pool (`NoFreeBlocksError`): the
# router requeues those alone; the others (a message past gRPC's size limit) never succeed.
KV_POOL_FULL = "KV pool full"
WHOLE_POOL = "more than this worker's whole pool"  # what `PoolTooSmallError` says


def pool_full(details: str) -> bool:
    """Whether a worker's RESOURCE_EXHAUSTED `details` say its pool was full for now (a worker
    from before `KV_POOL_FULL` says only `NoFreeBlocksError`'s message), not that the request
    never fits it (`PoolTooSmallError`: sending it again cannot help)."""
    if WHOLE_POOL in details:
        return False
    return KV_POOL_FULL in details or ("wanted" in details and "KV blocks, only" in details)


class NoFreeBlocksError(RuntimeError):
    """`allocate` asked for more blocks than are free or evictable; nothing changed."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"wanted {wanted} KV blocks, only {free} free (incl. evictable)")
        # Blocks requested.
        self.wanted = wanted
        # Blocks that were free or evictable at the time.
        self.free = free


class PoolTooSmallError(NoFreeBlocksError):
    """A request needs more blocks than the whole pool has: it never fits on this worker
    (said apart from a pool that is full for now; the router's capacity check refuses it
    up front once it knows the workers' pools)."""

    def __init__(self, wanted: int, num_blocks: int, field: str) -> None:
        super().__init__(wanted, num_blocks)
        self.args = (
            f"wanted {wanted} KV blocks, {WHOLE_POOL} ({num_blocks}, "
            f"its num_blocks setting): {field} asks for too many tokens",
        )


@dataclass(frozen=True, slots=True)
class KvEvent:
    """A change to the set of cached block hashes, for the router's prefix index."""

    # "stored": hashes entered the cache; "removed": evicted; "cleared": all dropped.
    kind: KvEventKind
    # The hashes concerned, in the order they changed (empty for "cleared").
    block_hashes: tuple[bytes, ...]


class BlockPool:
    """Free list, reference counts, `hash -> block` prefix cache and LRU eviction.

    See the module docstring for the states, the eviction order and who frees a block.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_prefix_cache: bool = True,
        on_event: Callable[[KvEvent], None] | None = None,
        record_events: bool = True,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        # Total blocks managed; ids are 0 .. num_blocks - 1.
        self.num_blocks = num_blocks
        # When False nothing is ever cached: cache_block is a no-op, lookups miss.
        self.enable_prefix_cache = enable_prefix_cache
        # Called synchronously with every event (after it is queued).
        self.on_event = on_event
        # Whether events are queued for drain_events.
        self.record_events = record_events
        # Free (uncached, count 0) blocks; allocate pops the left end, release appends right.
        self._free: deque[int] = deque(range(num_blocks))
        # Evictable (cached, count 0) blocks in LRU order: head evicted first, release appends.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Reference count per block id.
        self._refcount: list[int] = [0] * num_blocks
        # Prefix cache: block hash -> the one block holding it.
        self._hash_to_block: dict[bytes, int] = {}
        # Reverse of _hash_to_block; None for uncached blocks.
        self._block_to_hash: list[bytes | None] = [None] * num_blocks
        # Events not yet drained, oldest first.
        self._events: list[KvEvent] = []
        # Hashes looked up by find_cached_prefix / find_cached (one per block hash asked about).
        self.lookups = 0
        # Of those, hashes found (the returned prefix length, summed).
        self.hits = 0

    # ------------------------------------------------------------------------- counters

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a reference count of at least 1."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached hash (used or evictable)."""
        return len(self._hash_to_block)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks with no reference (evicted by allocation when free runs out)."""
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of a block."""
        self._check_id(block_id)
        return self._refcount[block_id]

    # ----------------------------------------------------------------------- prefix cache

    def find_cached_prefix(self, block_hashes: Sequence[bytes], *, count: bool = True) -> list[int]:
        """Block ids of the longest prefix of `block_hashes` that is cached.

        Takes no reference: `acquire` the result before any `allocate`. Counts each hash
        asked about in `lookups` and each hit in `hits`, unless not `count` (the caller
        counts what it used: `count_lookups`).
        """
        out: list[int] = []
        if self.enable_prefix_cache:
            for block_hash in block_hashes:
                block_id = self._hash_to_block.get(block_hash)
                if block_id is None:
                    break
                out.append(block_id)
        if count:
            self.count_lookups(len(block_hashes), len(out))
        return out

    def find_cached(self, block_hashes: Sequence[bytes], *, count: bool = True) -> list[int | None]:
        """For each hash, the block caching it or None (not only a prefix: a pulled prompt
        reuses any cached block). Takes no reference; counts like `find_cached_prefix`
        unless not `count` (the caller counts what it used: `count_lookups`)."""
        out = [self._hash_to_block.get(h) for h in block_hashes]
        if count:
            self.count_lookups(len(out), sum(b is not None for b in out))
        return out

    def count_lookups(self, asked: int, hit: int) -> None:
        """Count `asked` hashes looked up, `hit` of them found."""
        self.lookups += asked
        self.hits += hit

    def get(self, block_hash: bytes) -> int | None:
        """The block caching `block_hash`, or None. Takes no reference and counts nothing."""
        return self._hash_to_block.get(block_hash)

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the prefix cache, in the order it entered (oldest first).

        With the events that follow, a listener's exact view of the cache: an entry leaves
        this list exactly when a "removed" or "cleared" event names it.
        """
        return list(self._hash_to_block)

    def block_hash_of(self, block_id: int) -> bytes | None:
        """The hash block `block_id` is cached under, or None."""
        self._check_id(block_id)
        return self._block_to_hash[block_id]

    def cache_block(self, block_id: int, block_hash: bytes) -> int:
        """Record a full, referenced block under its hash; return the block now caching it.

        Returns `block_id` when recorded (or already recorded under this hash) and emits a
        "stored" event for a new entry. If another block already caches `block_hash`, returns
        that block and records nothing: the caller may switch to the existing block
        (acquire it, release its own) or keep its private copy. With the prefix cache
        disabled, records nothing and returns `block_id`.
        """
        stored = self._cache_one(block_id, block_hash)
        if stored:
            self._emit(KvEvent("stored", (block_hash,)))
        return self._hash_to_block.get(block_hash, block_id)

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> list[int]:
        """`cache_block` for several blocks, with one "stored" event for the new entries."""
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} blocks for {len(block_hashes)} hashes")
        new: list[bytes] = []
        out: list[int] = []
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if self._cache_one(block_id, block_hash):
                new.append(block_hash)
            out.append(self._hash_to_block.get(block_hash, block_id))
        if new:
            self._emit(KvEvent("stored", tuple(new)))
        return out

    def uncache_block(self, block_id: int) -> None:
        """Forget the hash block `block_id` caches (no-op when uncached); an evictable block
        becomes free, a referenced one stays with its holders. Emits "removed"."""
        self._check_id(block_id)
        block_hash = self._block_to_hash[block_id]
        if block_hash is None:
            return
        del self._hash_to_block[block_hash]
        self._block_to_hash[block_id] = None
        if block_id in self._evictable:
            del self._evictable[block_id]
            self._free.append(block_id)
        self._emit(KvEvent("removed", (block_hash,)))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; evictable blocks become free. Emits "cleared".

        Referenced blocks stay with their holders (now uncached, so freed on release).
        """
        for block_id in self._hash_to_block.values():
            self._block_to_hash[block_id] = None
        self._hash_to_block.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        if self.enable_prefix_cache:
            self._emit(KvEvent("cleared", ()))

    # ---------------------------------------------------------------------- references

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed now."""
        return 0 <= n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with reference count 1, owned by the caller until it releases them.

        Takes free blocks first (FIFO), then evicts evictable blocks from the LRU head
        (their hashes leave the cache; one "removed" event). Raises `NoFreeBlocksError`
        without changing anything when fewer than `n` are available.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(n, self.num_free_blocks)
        out: list[int] = []
        removed: list[bytes] = []
        while len(out) < n and self._free:
            out.append(self._free.popleft())
        while len(out) < n:
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._block_to_hash[block_id]
            assert block_hash is not None, "evictable block without a hash"
            del self._hash_to_block[block_hash]
            self._block_to_hash[block_id] = None
            removed.append(block_hash)
            out.append(block_id)
        for block_id in out:
            self._refcount[block_id] = 1
        if removed:
            self._emit(KvEvent("removed", tuple(removed)))
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (e.g. a cache hit); an evictable block
        leaves the LRU queue. Each block must be used or cached; all-or-nothing."""
        ids = list(block_ids)
        for block_id in ids:
            self._check_id(block_id)
            if self._refcount[block_id] == 0 and block_id not in self._evictable:
                raise ValueError(f"cannot acquire block {block_id}: it is free and not cached")
        for block_id in ids:
            if self._refcount[block_id] == 0:
                del self._evictable[block_id]
            self._refcount[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, processing `block_ids` LAST TO FIRST.

        Pass a sequence's blocks in sequence order: its tail then enters the LRU queue
        first and is evicted first. A block reaching 0 becomes evictable if cached, else
        free. Releasing more references than held raises ValueError; all-or-nothing.
        """
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if self._refcount[block_id] < times:
                raise ValueError(
                    f"double release of block {block_id} "
                    f"(ref count {self._refcount[block_id]}, released {times}x)"
                )
        for block_id in reversed(block_ids):
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                if self._block_to_hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # -------------------------------------------------------------------------- events

    def drain_events(self) -> list[KvEvent]:
        """Queued events, oldest first; the queue is emptied."""
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------------------- debug

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (tests, debugging). Raises AssertionError."""
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "duplicate in free list"
        assert not free & evictable, "block both free and evictable"
        for block_id in range(self.num_blocks):
            count = self._refcount[block_id]
            cached = self._block_to_hash[block_id] is not None
            assert count >= 0, f"negative ref count on {block_id}"
            in_free, in_evictable = block_id in free, block_id in evictable
            if count > 0:
                assert not in_free and not in_evictable, f"used block {block_id} is queued"
            else:
                assert in_free != in_evictable, f"unreferenced block {block_id} lost or doubled"
                assert in_evictable == cached, f"block {block_id} in the wrong queue"
        assert len(self._hash_to_block) == sum(h is not None for h in self._block_to_hash)
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_to_hash[block_id] == block_hash, "hash maps disagree"

    # ------------------------------------------------------------------------- internals

    def _cache_one(self, block_id: int, block_hash: bytes) -> bool:
        """Record one entry; True when it is new."""
        self._check_id(block_id)
        if not self.enable_prefix_cache:
            return False
        if self._refcount[block_id] == 0:
            raise ValueError(f"cannot cache block {block_id}: it is not referenced")
        current = self._block_to_hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return False
        if block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    def _emit(self, event: KvEvent) -> None:
        if self.record_events:
            self._events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
