"""`router.prefix_index.PrefixIndex`: the per-worker sets and the shared holder bits stay in
agreement through any sequence of KV events, and `cached_prefixes` (one lookup per block
for every worker) equals each worker's prefix read from its own set."""

from __future__ import annotations

import itertools

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
    assert got == {a: n for a, n in expected.items() if n}
    assert all(prefix.cached_prefix(a, asked) == n for a, n in expected.items())
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


def test_a_forgotten_workers_bit_is_reused_without_its_blocks() -> None:
    prefix = index()
    stored = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=HASHES[:3])
    prefix._apply(ADDRESSES[0], [stored])
    prefix.forget(ADDRESSES[0])
    prefix._apply(ADDRESSES[1], [kv_pb2.KvEvent(kind=stored.kind, block_hashes=HASHES[:1])])
    assert prefix._bits == {ADDRESSES[1]: 1}
    assert prefix.cached_prefixes(HASHES[:3]) == {ADDRESSES[1]: 1}
    assert prefix.cached_prefixes([]) == {}
