"""A prompt whose layout cannot be hashed is uncacheable (DESIGN §3): computed, but never
entered into the prefix cache, never reused by another request and never announced in a KV
event. (Its own handoff still moves its KV, bound by its digests: `test_decode_worker`.)"""

from __future__ import annotations

import pytest

from common.kv import allocator as allocator_module
from common.kv.allocator import KvAllocator
from common.kv.block_pool import BlockPool, KvEvent
from common.multimodal.params import MultimodalParams


def test_an_uncacheable_prompt_is_computed_but_never_cached_or_announced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[KvEvent] = []
    kv = KvAllocator(BlockPool(16, record_events=False), block_size=4, root=b"r" * 32)
    kv.listeners.append(events.append)
    tokens = list(range(13))  # 3 full blocks and one token more
    hashes = kv.hashes(tokens, MultimodalParams())
    assert hashes is not None and len(hashes) == 3
    blocks = kv.allocate_prompt(kv.cached_prefix(hashes, len(tokens)), len(tokens))
    kv.cache_prompt(blocks, hashes, len(tokens), 0)  # a cacheable one: cached, announced
    stored = len(events)
    assert stored and kv.cached_prefix(hashes, len(tokens) + 1) == blocks[:3]
    kv.release(blocks)
    cached_first = blocks[:3]

    def unhashable(*args: object, **kwargs: object) -> list[bytes]:
        raise ValueError("an item's run is past the prompt")

    monkeypatch.setattr(allocator_module, "block_hashes", unhashable)
    other = list(range(100, 113))
    assert kv.hashes(other, MultimodalParams()) is None  # uncacheable
    assert kv.cached_prefix(None, len(other)) == []  # reuses nothing
    blocks = kv.allocate_prompt([], len(other))
    kv.cache_prompt(blocks, None, len(other), 0)  # computed: caches nothing
    assert len(events) == stored  # announces nothing
    kv.release(blocks)
    assert kv.cached_prefix(hashes, len(tokens) + 1) == cached_first  # as it was
