"""`router.prefix_index.PrefixIndex`: the per-worker sets and the shared holder bits stay in
agreement through any sequence of KV events; `cached_prefixes` (a binary search per worker)
equals each worker's prefix read from its own set wherever a worker holds a prefix of the
prompt's blocks, as workers do, and otherwise ends on a block the worker holds, at or past
its prefix."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd.v1 import kv_pb2
from router.prefix_index import PrefixIndex

HASHES = [bytes([i]) * 32 for i in range(12)]
KINDS = (
    kv_pb2.KV_EVENT_KIND_STORED,
    kv_pb2.KV_EVENT_KIND_REMOVED,
    kv_pb2.KV_EVENT_KIND_CLEARED,
)
ADDRESSES = [f"127.0.0.1:{9000 + k}" for k in range(4)]

# One step: (worker, kind, hashes) applied as an event, or (worker, None, _): forget it.
steps = st.lists(
    st.tuples(
        st.integers(0, len(ADDRESSES) - 1),
        st.sampled_from((*KINDS, None)),
        st.lists(st.integers(0, len(HASHES) - 1), max_size=8),
    ),
    max_size=40,
)


def index() -> PrefixIndex:
    return PrefixIndex(channels=None)  # type: ignore[arg-type]  # events applied by hand


@given(steps, st.lists(st.integers(0, len(HASHES) - 1), max_size=12))
@settings(max_examples=200, deadline=None)
def test_cached_prefixes_equals_cached_prefix_per_worker(
    events: list[tuple[int, int | None, list[int]]], prompt: list[int]
) -> None:
    prefix = index()
    for worker, kind, hashes in events:
        address = ADDRESSES[worker]
        if kind is None:
            prefix.forget(address)
        else:
            event = kv_pb2.KvEvent(kind=kind, block_hashes=[HASHES[h] for h in hashes])  # type: ignore[arg-type]
            prefix._apply(address, [event])
    asked = [HASHES[h] for h in prompt]
    # Each worker's prefix read from its own set, one block at a time.
    expected = {
        a: len(list(itertools.takewhile(prefix._hashes.get(a, set()).__contains__, asked)))
        for a in ADDRESSES
    }
    got = prefix.cached_prefixes(asked)
    for address, n in expected.items():
        cached = prefix._hashes.get(address, set())
        found = got.get(address, 0)
        assert prefix.cached_prefix(address, asked) == found
        if all(h not in cached for h in asked[n:]):  # a prefix of the prompt: exact
            assert found == n
        else:  # a hole: a hint, but always ending on a block it holds
            assert found >= n and (found == 0 or asked[found - 1] in cached)
    # The holder bits are exactly the sets: nothing stale after removals and forgets.
    holders: dict[bytes, set[str]] = {}
    for address, cached in prefix._hashes.items():
        for h in cached:
            holders.setdefault(h, set()).add(address)
    bits = {bit: a for a, bit in prefix._bits.items()}
    decoded = {
        h: {bits[1 << k] for k in range(mask.bit_length()) if mask >> k & 1}
        for h, mask in prefix._holders.items()
    }
    assert decoded == holders


@given(
    st.lists(st.integers(0, 40), min_size=len(ADDRESSES), max_size=len(ADDRESSES)),
    st.integers(0, 40),
)
@settings(max_examples=200, deadline=None)
def test_cached_prefixes_of_prefix_holders_are_exact(held: list[int], asked: int) -> None:
    """Each worker holds the first `held[k]` blocks of a 40-block chain (and other blocks):
    the search finds exactly that many of the first `asked`."""
    chain = [k.to_bytes(32, "little") for k in range(40)]
    prefix = index()
    for k, (address, n) in enumerate(zip(ADDRESSES, held, strict=True)):
        other = [bytes([k + 1]) * 32]
        event = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=chain[:n] + other)
        prefix._apply(address, [event])
    got = prefix.cached_prefixes(chain[:asked])
    assert got == {a: min(n, asked) for a, n in zip(ADDRESSES, held, strict=True) if min(n, asked)}


def test_a_forgotten_workers_bit_is_reused_without_its_blocks() -> None:
    prefix = index()
    stored = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=HASHES[:3])
    prefix._apply(ADDRESSES[0], [stored])
    prefix.forget(ADDRESSES[0])
    prefix._apply(ADDRESSES[1], [kv_pb2.KvEvent(kind=stored.kind, block_hashes=HASHES[:1])])
    assert prefix._bits == {ADDRESSES[1]: 1}
    assert prefix.cached_prefixes(HASHES[:3]) == {ADDRESSES[1]: 1}
    assert prefix.cached_prefixes([]) == {}


def test_a_worker_announcing_without_end_is_dropped_not_held(monkeypatch) -> None:
    # A worker's announcements are bounded: hashes of another length are not kept, and past
    # the cap its blocks are forgotten (no hint) rather than growing the router's memory.
    import router.prefix_index as module

    monkeypatch.setattr(module, "MAX_HASHES_PER_WORKER", 8)
    prefix = index()
    address = ADDRESSES[0]
    odd = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=[b"x" * 100_000])
    prefix._apply(address, [odd])
    assert prefix._hashes[address] == set() and prefix._holders == {}
    stored = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=HASHES[:6])
    prefix._apply(address, [stored])
    assert len(prefix._hashes[address]) == 6
    # Blocks it holds already, announced again (stored anew after an eviction race, or
    # by another path), are not more of them: at the cap, nothing is dropped.
    again = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=HASHES[:8])
    prefix._apply(address, [again])
    assert len(prefix._hashes[address]) == 8
    prefix._apply(address, [again])
    assert len(prefix._hashes[address]) == 8
    more = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=HASHES[8:])
    prefix._apply(address, [more])
    assert prefix._hashes[address] == set() and prefix._holders == {}


def test_an_event_of_a_kind_this_router_does_not_know_drops_the_workers_hints() -> None:
    # From a newer worker: skipped without a word, it left that worker's hints stale.
    prefix = index()
    address = ADDRESSES[0]
    stored = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=HASHES[:3])
    prefix._apply(address, [stored, kv_pb2.KvEvent(kind=9, block_hashes=HASHES[:1])])  # type: ignore[arg-type]
    assert prefix._hashes[address] == set() and prefix.cached_prefixes(HASHES[:3]) == {}


@pytest.mark.parametrize("cut", ["channel closed", "follower failed"])
async def test_a_stream_cut_is_followed_again(cut: str) -> None:
    # Closing a worker's channel (`PeerClient.keep_only`) cancels its calls: the follower
    # ended as cancelled, keeping the worker's last hashes for good, never resubscribing.
    # One that failed otherwise (an error applying events) ended so too (routing review).
    import asyncio

    import grpc

    from common.roles import Role
    from common.server.peers import PeerClient
    from epd.v1 import prefill_service_pb2, prefill_service_pb2_grpc

    hashes = [bytes([k]) * 32 for k in range(4)]
    subscriptions = 0

    class Worker(prefill_service_pb2_grpc.PrefillServiceServicer):
        async def StreamKvEvents(self, request: object, context: object) -> object:
            nonlocal subscriptions
            subscriptions += 1
            stored = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=hashes)
            yield prefill_service_pb2.StreamKvEventsResponse(events=[stored])
            await asyncio.sleep(60)

    async def until(done: Callable[[], bool]) -> None:
        for _ in range(500):
            if done():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("not within 10 s")

    server = grpc.aio.server()
    prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server(Worker(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    peers = PeerClient()
    index = PrefixIndex(peers, retry_s=0.05)
    if cut == "follower failed":
        apply, failed = index._apply, list[int]()

        def fails_once(*args: Any) -> None:
            if not failed:
                failed.append(1)
                raise RuntimeError("applying events failed")
            apply(*args)

        index._apply = fails_once  # type: ignore[method-assign,assignment]
    try:
        index.track(address, Role.PREFILL)
        await until(lambda: subscriptions == 1)
        if cut == "channel closed":
            await until(lambda: index.cached_prefix(address, hashes) == 4)
            peers.keep_only(set())
        await until(lambda: subscriptions == 2)
        assert not index._tasks[address].done()
        await until(lambda: index.cached_prefix(address, hashes) == 4)  # the snapshot applied
        index.forget(address)  # its own cancellation still ends it
        await asyncio.sleep(0.1)
        assert address not in index._tasks and subscriptions == 2
    finally:
        await index.close()
        await peers.close()
        await server.stop(0)


def test_hashes_announced_again_at_the_bound_cost_no_copy_of_the_workers_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At the bound each STORED event copied the worker's whole set to count what it added:
    # 0.13 s for a 36-byte event at 1M hashes; a registered worker held the router's loop
    # 26 s with 8 KB (routing review). Only the event's new hashes are counted now.
    import time

    import router.prefix_index as module

    monkeypatch.setattr(module, "MAX_HASHES_PER_WORKER", 1 << 17)
    prefix = index()
    held = [k.to_bytes(32, "big") for k in range(1 << 17)]
    prefix._apply("w", [kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=held)])
    again = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=[held[5]])
    started = time.perf_counter()
    prefix._apply("w", [again] * 1000)  # a copy each: several seconds
    assert time.perf_counter() - started < 1.0
    assert len(prefix._hashes["w"]) == 1 << 17  # announced again: still held
    more = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=[b"\xff" * 32])
    prefix._apply("w", [more])
    assert prefix._hashes["w"] == set()  # past the bound: dropped
