"""BlockPool: exact block ids, eviction order, KV events, and random-operation invariants."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.block_pool import BlockPool, KvEvent, NoFreeBlocksError


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_fresh_pool_allocates_in_id_order():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 5)
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_released_uncached_blocks_go_to_the_free_tail():
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.release(a)  # released last to first: 1 then 0
    assert pool.allocate(4) == [2, 3, 1, 0]


def test_free_blocks_are_used_before_evicting_cached_ones():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_blocks(a, [h(0), h(1)])
    pool.release(a)
    assert pool.num_evictable_blocks == 2 and pool.num_free_blocks == 4
    assert pool.allocate(2) == [2, 3]  # never-cached blocks first
    assert pool.num_cached_blocks == 2
    assert pool.drain_events() == [KvEvent("stored", (h(0), h(1)))]


def test_eviction_order_is_lru_with_sequence_tail_first():
    pool = BlockPool(5)
    seq_a = pool.allocate(3)  # [0, 1, 2]
    pool.cache_blocks(seq_a, [h(0), h(1), h(2)])
    seq_b = pool.allocate(2)  # [3, 4]
    pool.cache_blocks(seq_b, [h(3), h(4)])
    pool.release(seq_a)  # queue: 2, 1, 0
    pool.release(seq_b)  # queue: 2, 1, 0, 4, 3
    pool.drain_events()
    assert pool.allocate(1) == [2]
    assert pool.allocate(2) == [1, 0]
    assert pool.drain_events() == [KvEvent("removed", (h(2),)), KvEvent("removed", (h(1), h(0)))]
    assert pool.get(h(2)) is None and pool.block_hash_of(2) is None
    assert pool.find_cached_prefix([h(3), h(4)]) == [3, 4]
    assert pool.allocate(2) == [4, 3]
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_acquire_revives_an_evictable_block_and_release_requeues_it_at_the_tail():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [h(0), h(1), h(2)])
    pool.release(blocks)  # queue: 2, 1, 0
    hit = pool.find_cached_prefix([h(0), h(1), h(9)])
    assert hit == [0, 1]
    assert (pool.hits, pool.lookups) == (2, 3)
    pool.acquire(hit)  # queue: 2
    assert pool.ref_count(0) == 1 and pool.num_used_blocks == 2
    pool.acquire([0])  # a second sequence shares block 0
    pool.release([0])
    assert pool.ref_count(0) == 1
    pool.release(hit)  # queue: 2, 1, 0
    assert pool.allocate(3) == [2, 1, 0]


def test_allocate_failure_changes_nothing():
    pool = BlockPool(3)
    held = pool.allocate(2)
    pool.cache_block(held[0], h(7))
    pool.release(held[:1])
    events = pool.drain_events()
    with pytest.raises(NoFreeBlocksError, match="wanted 3 KV blocks, only 2 free") as err:
        pool.allocate(3)
    assert (err.value.wanted, err.value.free) == (3, 2)
    assert not pool.can_allocate(3) and pool.can_allocate(2)
    assert pool.get(h(7)) == 0 and pool.num_free_blocks == 2
    assert events == [KvEvent("stored", (h(7),))] and pool.drain_events() == []
    pool.check_invariants()


def test_double_release_and_bad_acquire_raise_without_side_effects():
    pool = BlockPool(3)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="double release of block 0"):
        pool.release([1, 0, 0])
    assert pool.ref_count(0) == pool.ref_count(1) == 1
    pool.release(a)
    with pytest.raises(ValueError, match="double release"):
        pool.release([0])
    with pytest.raises(ValueError, match="free and not cached"):
        pool.acquire([2])
    with pytest.raises(IndexError):
        pool.release([3])
    pool.check_invariants()


def test_cache_block_never_duplicates_a_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1)) == a
    assert pool.cache_block(a, h(1)) == a  # idempotent, no second event
    assert pool.cache_block(b, h(1)) == a  # caller decides what to do with b
    assert pool.block_hash_of(b) is None and pool.num_cached_blocks == 1
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(a, h(2))
    with pytest.raises(ValueError, match="not referenced"):
        pool.cache_block(3, h(3))
    assert pool.drain_events() == [KvEvent("stored", (h(1),))]


def test_reset_prefix_cache_frees_evictable_and_uncaches_used_blocks():
    seen: list[KvEvent] = []
    pool = BlockPool(4, on_event=seen.append)
    a = pool.allocate(2)
    pool.cache_blocks(a, [h(0), h(1)])
    pool.release(a[1:])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.num_evictable_blocks == 0
    assert pool.find_cached_prefix([h(0)]) == []
    pool.release(a[:1])  # uncached now, so straight to the free list
    assert pool.num_free_blocks == 4
    assert (
        pool.drain_events()
        == seen
        == [
            KvEvent("stored", (h(0), h(1))),
            KvEvent("cleared", ()),
        ]
    )
    pool.check_invariants()


def test_disabled_prefix_cache_never_caches_or_emits():
    pool = BlockPool(2, enable_prefix_cache=False, record_events=False)
    a = pool.allocate(2)
    assert pool.cache_blocks(a, [h(0), h(1)]) == a
    assert pool.get(h(0)) is None and pool.find_cached_prefix([h(0)]) == []
    pool.release(a)
    assert pool.allocate(2) == [1, 0]
    assert pool.drain_events() == []


@pytest.mark.parametrize("bad", [0, -1, True])
def test_bad_pool_size(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


# ----------------------------------------------------------------------------- properties

_op = st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 5)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("cache"), st.integers(0, 20), st.integers(0, 12)),
    st.tuples(st.just("hit"), st.lists(st.integers(0, 12), max_size=4)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=st.lists(_op, max_size=40))
def test_random_operations_keep_the_pool_consistent(num_blocks, ops):
    """A model of the pool: `held` lists every reference the 'scheduler' owns."""
    pool = BlockPool(num_blocks)
    held: list[int] = []  # one entry per reference held (may repeat a block id)
    cached: dict[bytes, int | None] = {}  # model of the prefix cache from the events
    for op in ops:
        if op[0] == "allocate":
            n = op[1]
            if pool.can_allocate(n):
                got = pool.allocate(n)
                assert len(set(got)) == n
                assert not set(got) & set(held), "allocated a block someone holds"
                held.extend(got)
            else:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n)
        elif op[0] == "release" and held:
            block_id = held.pop(op[1] % len(held))
            pool.release([block_id])
        elif op[0] == "cache" and held:
            block_id = held[op[1] % len(held)]
            current = pool.block_hash_of(block_id)
            if current is None or current == h(op[2]):
                got = pool.cache_block(block_id, h(op[2]))
                assert pool.get(h(op[2])) == got
            else:
                with pytest.raises(ValueError, match="another hash"):
                    pool.cache_block(block_id, h(op[2]))
        elif op[0] == "hit":
            hashes = [h(i) for i in op[1]]
            prefix = pool.find_cached_prefix(hashes)
            assert prefix == [pool.get(x) for x in hashes[: len(prefix)]]
            pool.acquire(prefix)
            held.extend(prefix)
        elif op[0] == "reset":
            pool.reset_prefix_cache()
        for event in pool.drain_events():
            if event.kind == "stored":
                for x in event.block_hashes:
                    assert x not in cached
                    cached[x] = pool.get(x)
            elif event.kind == "removed":
                for x in event.block_hashes:
                    del cached[x]
                    assert pool.get(x) is None
                    assert pool.find_cached_prefix([x]) == []
            else:
                cached.clear()
        pool.check_invariants()
        assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
        assert pool.num_used_blocks == len(set(held))
        for block_id in range(num_blocks):
            assert pool.ref_count(block_id) == held.count(block_id)
        assert cached == {x: b for x in cached if (b := pool.get(x)) is not None}
        assert len(cached) == pool.num_cached_blocks


def test_find_cached_looks_past_a_miss_and_counts_hits():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [h(0), h(2)])
    assert pool.find_cached([h(0), h(1), h(2)]) == [0, None, 1]
    assert (pool.hits, pool.lookups) == (2, 3)
    assert pool.ref_count(0) == 1  # no reference taken
    pool.release(blocks)
    pool.check_invariants()


def test_cached_hashes_follow_entry_order_eviction_and_reset():
    pool = BlockPool(3)
    first = pool.allocate(2)
    pool.cache_blocks(first, [h(5), h(1)])
    second = pool.allocate(1)
    pool.cache_block(second[0], h(3))
    assert pool.cached_hashes() == [h(5), h(1), h(3)]  # the order they entered
    pool.release(first)  # queue: 1, 0 (tail first)
    pool.allocate(1)  # evicts block 1 (h(1))
    assert pool.cached_hashes() == [h(5), h(3)]
    pool.reset_prefix_cache()
    assert pool.cached_hashes() == []


# A prompt is a path of block choices; its blocks' hashes are its prefixes (a hash chain).
paths = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)


@given(
    st.integers(4, 12),
    st.lists(st.tuples(st.sampled_from(("run", "finish")), paths, st.integers(0, 9)), max_size=40),
)
@settings(max_examples=200, deadline=None)
def test_a_cached_block_never_outlives_the_blocks_before_it(num_blocks, ops):
    """Sequences admitted as the allocator does (acquire the cached prefix, compute and
    cache the rest) and released in sequence order, interleaved at random under eviction:
    every cached block's parent stays cached. The router's prefix search
    (`router.prefix_index`) is exact because of it."""
    pool = BlockPool(num_blocks)
    running: list[list[int]] = []

    def chain(path):  # the hash of each leading part of the path
        return [bytes([k, *path[:k]]) for k in range(1, len(path) + 1)]

    for op, path, pick in ops:
        if op == "run":
            hashes = chain(path)
            prefix = pool.find_cached_prefix(hashes)
            pool.acquire(prefix)
            rest = len(hashes) - len(prefix)
            if not pool.can_allocate(rest):
                pool.release(prefix)
                continue
            fresh = pool.allocate(rest)
            blocks = prefix + pool.cache_blocks(fresh, hashes[len(prefix) :])
            running.append(blocks)
        elif running:
            pool.release(running.pop(pick % len(running)))
        pool.drain_events()
        cached = set(pool.cached_hashes())
        for x in cached:
            parent = x[1:-1]  # the path without its last block
            assert not parent or bytes([len(parent), *parent]) in cached, f"{x!r} without parent"


async def test_a_kv_event_subscriber_too_far_behind_is_cut_off(monkeypatch: Any) -> None:
    # Each subscriber's queue of live events had no bound: a router reading slower than the
    # pool changes grew the worker's memory without end. Now its stream ends, and it
    # subscribes again from a fresh snapshot.
    import asyncio

    import grpc

    from common.kv import events
    from common.server.kv_worker import stream_kv_events
    from common.server.rpc import RpcStatusError

    monkeypatch.setattr(events, "MAX_QUEUED_EVENTS", 4)

    class Allocator:
        def __init__(self) -> None:
            self.listeners: list[Any] = []

        def cached_hashes(self) -> list[bytes]:
            return [b"a"]

    class Model:  # the model thread, run inline
        async def call(self, fn: Any, *args: Any, on_orphan: Any = None) -> Any:
            return fn(*args)

    hub = events.KvEventHub(Allocator())  # type: ignore[arg-type]
    stream = stream_kv_events(hub, Model(), "slow")  # type: ignore[arg-type]
    (snapshot,) = await stream.__anext__()
    assert snapshot.event.block_hashes == (b"a",)
    for i in range(3):
        hub.on_event(KvEvent("stored", (bytes([i]),)))
    await asyncio.sleep(0.01)
    assert [e.sequence for e in await stream.__anext__()] == [1, 2, 3]  # within the bound
    for i in range(10):
        hub.on_event(KvEvent("stored", (bytes([i]),)))
    await asyncio.sleep(0.01)
    with pytest.raises(RpcStatusError) as err:
        await stream.__anext__()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "subscribe again" in err.value.details and hub.subscribers == 0
