"""Tests for the encoder worker's encoding: outputs equal the vision tower's (batched images,
partitioned video bit-exact), repeats are cache hits, partition subsets return those rows
(and a fresh worker encodes only those), the LRU cache's order and byte budget, concurrent
requests sharing one forward, and malformed items refused naming the field, caching nothing."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from common.byte_lru import ENTRY_BYTES
from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import Processor
from common.wire.convert import tensor_from_ref, tensor_to_ref
from encoder_worker.cache import EncodedRows, EncoderCache
from epd.v1 import encoder_service_pb2, multimodal_pb2
from tests.encoder_worker_helpers import (
    Factory,
    _count_forwards,
    _engine,
    _image,
    _item,
    _request,
    _rows,
    _video,
    make_server,
    tower,
)

__all__ = ["make_server", "tower"]  # fixtures shared with the other encoder worker tests

# ---------------------------------------------------------------------------- the tests


async def test_output_equals_vision_tower(
    make_server: Factory, processor: Processor, tower: VisionTower
) -> None:
    _, stub = await make_server()
    images = [_image(processor, 1), _image(processor, 2, 48, 80)]
    video = _video(processor, 3)
    reply = await stub.Encode(_request(*(_item(p) for p in images), _item(video)), timeout=30)
    assert len(reply.items) == 3

    # The worker batches the two whole images into one forward: the same call here.
    pixels = torch.cat([p.vision_inputs()[0] for p in images])
    grids = torch.tensor([p.grid_thw[0] for p in images])
    rows, deep = tower.encode(pixels, grids)
    sizes = tower.rows_per_item(grids)
    for k, prompt in enumerate(images):
        got_rows, got_deep = _rows(reply.items[k])
        assert reply.items[k].content_hash == prompt.params.items[0].content_hash
        assert not reply.items[k].cache_hit
        assert torch.equal(got_rows, rows.split(sizes)[k])
        assert all(torch.equal(g, d.split(sizes)[k]) for g, d in zip(got_deep, deep, strict=True))
        solo, _ = tower.encode(*prompt.vision_inputs())
        torch.testing.assert_close(got_rows, solo, rtol=1e-5, atol=1e-5)

    # Partitioned video: frame-by-frame encoding, bit-exact; equal to the whole pass too.
    v_pixels, v_grid = video.vision_inputs()
    exact_rows, exact_deep = tower.encode(v_pixels, v_grid, per_frame=True)
    got_rows, got_deep = _rows(reply.items[2])
    assert torch.equal(got_rows, exact_rows)
    assert all(torch.equal(g, d) for g, d in zip(got_deep, exact_deep, strict=True))
    whole_rows, _ = tower.encode(v_pixels, v_grid)
    torch.testing.assert_close(got_rows, whole_rows, rtol=1e-5, atol=1e-5)
    assert got_rows.shape == (video.params.items[0].length, tower.config.out_hidden_size)


async def test_second_request_is_a_cache_hit(make_server: Factory, processor: Processor) -> None:
    server, stub = await make_server()
    calls = _count_forwards(server)
    request = _request(_item(_image(processor, 4)))
    first = await stub.Encode(request, timeout=30)
    assert calls[0] == 1
    second = await stub.Encode(request, timeout=30)
    assert calls[0] == 1  # no vision forward
    assert second.items[0].cache_hit and not first.items[0].cache_hit
    assert torch.equal(_rows(first.items[0])[0], _rows(second.items[0])[0])
    load = server.servicer.load() if server.servicer else None
    assert load is not None and (load.cache_hits, load.cache_lookups) == (1, 2)
    assert _engine(server).forward_calls == 1
    assert server.servicer is not None
    counters = server.servicer.counters
    assert counters.cache_entries == 1 and counters.rows_encoded == 4


async def test_partition_subset_returns_those_rows(
    make_server: Factory, processor: Processor
) -> None:
    server, stub = await make_server()
    video = _video(processor, 5)
    parts = video.params.items[0].partitions
    assert len(parts) == 3
    whole = await stub.Encode(_request(_item(video)), timeout=30)
    whole_rows, whole_deep = _rows(whole.items[0])
    bounds = np.cumsum([0] + [p.output_rows for p in parts])

    def expected(ps: tuple[int, ...], t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[bounds[p] : bounds[p + 1]] for p in ps])

    calls = _count_forwards(server)
    for subset_pixels in (False, True):
        reply = await stub.Encode(_request(_item(video, (0, 2), subset_pixels)), timeout=30)
        got_rows, got_deep = _rows(reply.items[0])
        assert list(reply.items[0].partition_indices) == [0, 2]
        assert reply.items[0].cache_hit
        assert torch.equal(got_rows, expected((0, 2), whole_rows))
        assert torch.equal(got_deep[1], expected((0, 2), whole_deep[1]))
    assert calls[0] == 0

    # A fresh worker encodes only the partitions asked for, and later only the rest.
    fresh, fresh_stub = await make_server()
    reply = await fresh_stub.Encode(_request(_item(video, (1,), subset_pixels=True)), timeout=30)
    assert torch.equal(_rows(reply.items[0])[0], expected((1,), whole_rows))
    assert _engine(fresh).rows_encoded == parts[1].output_rows
    reply = await fresh_stub.Encode(_request(_item(video)), timeout=30)
    assert torch.equal(_rows(reply.items[0])[0], whole_rows)
    assert not reply.items[0].cache_hit
    assert _engine(fresh).rows_encoded == sum(p.output_rows for p in parts)


def _entry(rows: int) -> EncodedRows:
    return EncodedRows.of(torch.zeros(rows, 4), (torch.zeros(rows, 4),))  # 32 bytes per row


def test_entry_overhead_counts_toward_the_budget() -> None:
    # Tiny rows cost more in objects than in bytes: a cache that serves traffic counts
    # `entry_bytes` per entry, so 0-byte or 1-row entries cannot hold memory without bound.
    cache = EncoderCache(budget_bytes=4 * (64 + 1024), entry_bytes=1024)
    for k in range(10):
        assert cache.put(bytes([k]), _entry(2))
    assert len(cache) == 4 and cache.bytes_used == 4 * (64 + 1024)
    for k in range(10):
        cache.put(bytes([100 + k]), _entry(0))
    assert len(cache) == 4  # counted at 1024 each, 0-byte entries evict as others do
    assert not EncoderCache(budget_bytes=1000, entry_bytes=1024).put(b"x", _entry(0))


def test_entries_added_to_a_held_owner_stay_within_the_budget() -> None:
    # More units of a segment already stored: each entry's overhead still counts, and older
    # entries make room for it (they skipped eviction, and the cache passed its budget).
    owner = _entry(2)
    views = [EncodedRows(owner.stacked, owner, 0, 2) for _ in range(6)]
    cache = EncoderCache(budget_bytes=64 + 3 * 1024, entry_bytes=1024)
    assert cache.put_many([b"a"], views[:1], owner)
    for k in range(1, 6):
        assert cache.put_many([bytes([k])], views[k : k + 1], owner)
        assert cache.bytes_used <= cache.budget_bytes
    assert len(cache) == 3 and cache.keys() == [bytes([3]), bytes([4]), bytes([5])]
    # More of its units than the budget holds with it: refused, and nothing evicted for it.
    more = [EncodedRows(owner.stacked, owner, 0, 2) for _ in range(4)]
    assert not cache.put_many([bytes([10 + k]) for k in range(4)], more, owner)
    assert cache.keys() == [bytes([3]), bytes([4]), bytes([5])] and cache.evictions == 3


def test_cache_lru_order_and_budget() -> None:
    cache = EncoderCache(budget_bytes=3 * 32 * 2)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, _entry(2))
    assert cache.bytes_used == 192
    assert cache.get(b"a") is not None  # a becomes most recent
    cache.put(b"d", _entry(2))
    assert cache.keys() == [b"c", b"a", b"d"] and cache.evictions == 1
    cache.put(b"e", _entry(4))  # needs two slots: evicts c and a
    assert cache.keys() == [b"d", b"e"] and cache.bytes_used == 192
    assert not cache.put(b"huge", _entry(7))  # larger than the budget: not stored
    assert b"huge" not in cache and cache.keys() == [b"d", b"e"]
    assert (cache.hits, cache.lookups) == (1, 1)


async def test_lru_eviction_in_the_worker(
    make_server: Factory, processor: Processor, tower: VisionTower
) -> None:
    prompts = [_image(processor, 10 + k) for k in range(3)]
    cfg = tower.config
    tensors = 1 + len(cfg.deepstack_visual_indexes)  # rows + deepstack layers, float32
    one_item = prompts[0].params.items[0].length * cfg.out_hidden_size * 4 * tensors
    # The worker counts each entry's objects beside its rows (`ENTRY_BYTES`).
    server, stub = await make_server(cache_bytes=2 * (one_item + ENTRY_BYTES))
    for prompt in prompts:
        await stub.Encode(_request(_item(prompt)), timeout=30)
    cache = _engine(server).cache
    hashes = [p.params.items[0].content_hash for p in prompts]
    assert cache.keys() == hashes[1:] and cache.evictions == 1
    calls = _count_forwards(server)
    again = await stub.Encode(_request(_item(prompts[0])), timeout=30)
    assert not again.items[0].cache_hit and calls[0] == 1
    assert cache.keys() == [hashes[2], hashes[0]]


async def test_concurrent_requests_share_one_forward(
    make_server: Factory, processor: Processor
) -> None:
    server, stub = await make_server(batch_window_ms=200)
    calls = _count_forwards(server)
    prompts = [_image(processor, 20 + k) for k in range(3)]
    requests = [_request(_item(p), request_id=f"r{k}") for k, p in enumerate(prompts)]
    requests.append(_request(_item(prompts[0]), request_id="r3"))
    replies = await asyncio.gather(*(stub.Encode(r, timeout=30) for r in requests))
    assert calls[0] == 1
    engine = _engine(server)
    assert engine.batches == 1 and engine.units_encoded == 3  # the duplicate joined
    assert torch.equal(_rows(replies[0].items[0])[0], _rows(replies[3].items[0])[0])


BAD_HASH = b"\x01" * 31


def _malformed(case: str, good: encoder_service_pb2.EncodeItem) -> encoder_service_pb2.EncodeItem:
    item = encoder_service_pb2.EncodeItem()
    item.CopyFrom(good)
    if case == "content_hash":
        item.content_hash = BAD_HASH
    elif case == "grid_thw":
        del item.grid_thw[:]
        item.grid_thw.extend([1, 4])
    elif case == "grid_merge":
        item.grid_thw[1] = 3
    elif case == "pixel_values":
        item.pixel_values.shape[0] -= 1
    elif case == "missing_pixels":
        item.ClearField("pixel_values")
    elif case == "partition_indices":
        item.partition_indices.extend([0, 7])
    elif case == "partition_order":
        item.partition_indices.extend([2, 1])
    elif case == "partitions_gap":
        item.partitions[1].input_start += 16
    elif case == "output_rows":
        item.partitions[0].output_rows += 1
    elif case == "partition_hash":
        item.partitions[2].content_hash = BAD_HASH
    elif case == "modality":
        item.modality = multimodal_pb2.MODALITY_AUDIO
    elif case == "nan_pixels":  # float32 values (an older router's), one of them NaN
        values = tensor_from_ref(item.pixel_values).float()
        values[3, 5] = float("nan")
        item.pixel_values.CopyFrom(tensor_to_ref(values))
    elif case == "deep_pixels":  # refused by the count of dimensions, before any tensor
        item.pixel_values.shape.extend([1] * 100_000)
    return item


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("content_hash", "content_hash"),
        ("grid_thw", "grid_thw"),
        ("grid_merge", "grid_thw"),
        ("pixel_values", "pixel_values"),
        ("missing_pixels", "pixel_values"),
        ("partition_indices", "partition_indices"),
        ("partition_order", "partition_indices"),
        ("partitions_gap", "partitions[1].input_start"),
        ("output_rows", "partitions[0].output_rows"),
        ("partition_hash", "partitions[2].content_hash"),
        ("modality", "modality"),
        ("nan_pixels", "pixel_values"),
        ("deep_pixels", "pixel_values"),
    ],
)
async def test_malformed_input_is_refused_and_caches_nothing(
    make_server: Factory, processor: Processor, case: str, field: str
) -> None:
    server, stub = await make_server()
    good_image = _item(_image(processor, 30))
    bad = _malformed(case, _item(_video(processor, 31)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(_request(good_image, bad), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details() and "item 1" in info.value.details()
    engine = _engine(server)
    assert len(engine.cache) == 0 and engine.forward_calls == 0
    assert (await stub.Encode(_request(good_image), timeout=30)).items[0].rows.shape
