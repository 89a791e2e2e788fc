"""The encoder's output cache (`EncoderCache`) and the rows it holds (`EncodedRows`): units that
share one encoded segment count its bytes once and free them with the last of them; LRU order
and owner accounting through get_many/put_many; a join is a view only of neighbours; a view
without an owner counts the memory it keeps alive.
"""

from __future__ import annotations

import torch

from encoder_worker.batch import join
from encoder_worker.cache import EncodedRows, EncoderCache


def test_shared_segment_counts_once_and_frees_with_its_last_unit() -> None:
    segment = EncodedRows.of(torch.zeros(6, 4), (torch.zeros(6, 4),))  # 192 bytes
    views = segment.stacked.split(2, dim=1)
    units = [EncodedRows(views[k], segment) for k in range(3)]
    cache = EncoderCache(budget_bytes=300)
    for k, unit in enumerate(units):
        assert cache.put(bytes([k]), unit)
    assert cache.bytes_used == segment.nbytes == 192
    assert cache.put(b"own", EncodedRows.of(torch.zeros(1, 4), (torch.zeros(1, 4),)))  # 32
    assert cache.bytes_used == 224
    # 96 more bytes do not fit: evicting units 0 and 1 frees nothing (unit 2 still holds
    # the segment), evicting unit 2 frees its 192 bytes.
    assert cache.put(b"new", EncodedRows.of(torch.zeros(3, 4), (torch.zeros(3, 4),)))
    assert cache.keys() == [b"own", b"new"] and cache.evictions == 3
    assert cache.bytes_used == 32 + 96
    assert not cache.put(b"big", EncodedRows.of(torch.zeros(10, 4), (torch.zeros(10, 4),)))


def test_join_is_a_view_only_for_neighbours() -> None:
    segment = EncodedRows.of(torch.arange(24.0).view(6, 4), (torch.zeros(6, 4),))
    views = segment.stacked.split([1, 2, 3], dim=1)
    bounds = ((0, 1), (1, 3), (3, 6))
    parts = [EncodedRows(v, segment, *b) for v, b in zip(views, bounds, strict=True)]
    whole = join(parts)
    assert torch.equal(whole.stacked, segment.stacked)
    assert whole.stacked.data_ptr() == segment.stacked.data_ptr()  # no copy
    tail = join(parts[1:])
    assert (tail.start, tail.stop) == (1, 6)
    assert torch.equal(tail.stacked, segment.stacked[:, 1:])
    skipped = join([parts[0], parts[2]])  # not neighbours: a copy
    assert torch.equal(skipped.stacked, torch.cat([views[0], views[2]], dim=1))
    assert skipped.owner is None


def test_get_many_and_put_many_keep_lru_and_owner_accounting() -> None:
    segment = EncodedRows.of(torch.zeros(6, 4), (torch.zeros(6, 4),))  # 192 bytes
    views = segment.stacked.split(2, dim=1)
    units = [EncodedRows(v, segment, 2 * k, 2 * k + 2) for k, v in enumerate(views)]
    cache = EncoderCache(budget_bytes=300)
    assert cache.put(b"old", EncodedRows.of(torch.zeros(2, 4), (torch.zeros(2, 4),)))  # 64
    assert cache.put_many([b"a", b"b", b"c"], units, segment)
    assert cache.bytes_used == 64 + 192 and cache.keys() == [b"old", b"a", b"b", b"c"]
    found = cache.get_many([b"b", b"x", b"old"])
    assert found == [units[1], None, cache.get(b"old")]
    assert (cache.hits, cache.lookups) == (3, 4)
    assert cache.keys() == [b"a", b"c", b"b", b"old"]
    # A second segment evicts from the LRU end until it fits: all of the first segment's
    # units go (its bytes only when the last one does), "old" stays.
    second = EncodedRows.of(torch.zeros(3, 4), (torch.zeros(3, 4),))  # 96 bytes
    assert cache.put_many([b"d"], [second], second)
    assert cache.keys() == [b"old", b"d"] and cache.bytes_used == 64 + 96
    assert cache.evictions == 3
    big = EncodedRows.of(torch.zeros(10, 4), (torch.zeros(10, 4),))
    assert not cache.put_many([b"e"], [big], big) and b"e" not in cache


def test_a_view_without_owner_counts_the_memory_it_keeps_alive() -> None:
    base = torch.zeros(3, 1000, 64)
    view = EncodedRows(base[:, :1])  # no owner: it alone keeps `base` alive
    assert view.nbytes == base.nbytes
    assert EncodedRows(base.clone()).nbytes == base.nbytes
