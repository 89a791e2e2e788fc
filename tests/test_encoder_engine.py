"""`EncoderEngine`'s batched input preparation (`encoder_worker.batch`): per-request queue
entries, one `cat` per mode and copied output segments split into per-unit views give
exactly the rows of the equivalent hand-made tower calls, and the rows of each item encoded
alone (bit for bit for frame-by-frame partitions), in the three shapes of
`benchmarks/encoder_input_bench.py`, through `encode` and `encode_now`, with cache hits,
in-flight joins, duplicates, partitions, small segments and `max_batch_rows` splits;
cancellation and a failed forward (the cache itself: tests/test_encoder_cache.py). The units
hold the processor's uint8 patch codes, as the router sends them; the engine maps them to
the tower's values (a mix with float32 values from an older router is tested too)."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.models.qwen3_vl.vision import VisionTower
from common.models.tiny import default_checkpoint
from common.processing.content_hash import content_hash, processor_settings
from common.processing.image import as_patch_values
from common.processing.processor import Processor
from encoder_worker import batch
from encoder_worker.cache import EncodedRows, EncoderCache
from encoder_worker.engine import EncoderEngine
from encoder_worker.requests import ItemJob, Unit
from encoder_worker.server import load_tower
from encoder_worker.settings import EncoderSettings


@functools.cache
def pixel_settings() -> Any:
    ckpt = default_checkpoint("tiny")
    return processor_settings(ckpt, Processor.from_pretrained(ckpt).config)


def make_engine(tower: VisionTower, cache: EncoderCache, **options: Any) -> EncoderEngine:
    """An engine that maps patch codes by the tiny checkpoint's processor settings."""
    return EncoderEngine(tower, cache, settings=pixel_settings(), **options)


@pytest.fixture(scope="module")
def tower(ckpt: Path) -> VisionTower:
    return load_tower(ckpt, EncoderSettings())[1]


def image_job(processor: Processor, seed: int, side: int = 32) -> ItemJob:
    data = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    prompt = processor.process([{"role": "user", "content": [{"type": "image", "image": data}]}])
    item = prompt.params.items[0]
    unit = Unit(item.content_hash, prompt.pixel_values[0], prompt.grid_thw[0], False, item.length)
    return ItemJob(item.content_hash, (), (unit,))


def video_job(processor: Processor, seed: int, frames: int = 4) -> ItemJob:
    rng = np.random.default_rng(1000 + seed)
    clip = rng.integers(0, 256, (frames, 32, 32, 3), dtype=np.uint8)
    prompt = processor.process(
        [{"role": "user", "content": [{"type": "video", "video": clip, "fps": 2.0}]}]
    )
    item = prompt.params.items[0]
    _, h, w = prompt.grid_thw[0]
    units = tuple(
        Unit(
            p.content_hash,
            prompt.pixel_values[0][p.input_start : p.input_end],
            ((p.input_end - p.input_start) // (h * w), h, w),
            True,
            p.output_rows,
        )
        for p in item.partitions
    )
    return ItemJob(item.content_hash, (), units)


def shape_jobs(processor: Processor, shape: str, seed: int) -> list[ItemJob]:
    if shape == "alternating":
        return [
            video_job(processor, seed + k) if k % 2 else image_job(processor, seed + k)
            for k in range(6)
        ]
    jobs = [image_job(processor, seed + k, 32 + 16 * (k % 2)) for k in range(6)]
    return [jobs[k] for k in (4, 1, 5, 0, 3, 2)] if shape == "reordered" else jobs


def hand_encode(tower: VisionTower, jobs: list[ItemJob]) -> dict[bytes, EncodedRows]:
    """The tower calls one batch of these jobs makes: distinct units in order, one call per
    mode, the output split per unit."""
    units: dict[bytes, Unit] = {}
    for job in jobs:
        for unit in job.units:
            units.setdefault(unit.key, unit)
    out: dict[bytes, EncodedRows] = {}
    for per_frame in (False, True):
        chosen = [u for u in units.values() if u.per_frame == per_frame]
        if not chosen:
            continue
        rows, deep = tower.encode(
            as_patch_values(torch.cat([u.pixels for u in chosen]), pixel_settings()),
            torch.tensor([u.grid for u in chosen]),
            per_frame=per_frame,
        )
        sizes = [u.output_rows for u in chosen]
        split_deep = [d.split(sizes) for d in deep]
        for k, (unit, r) in enumerate(zip(chosen, rows.split(sizes), strict=True)):
            out[unit.key] = EncodedRows.of(r, tuple(d[k] for d in split_deep))
    return out


def expected_rows(job: ItemJob, by_key: dict[bytes, EncodedRows]) -> EncodedRows:
    parts = [by_key[u.key] for u in job.units]
    return EncodedRows.of(
        torch.cat([p.rows for p in parts]),
        tuple(torch.cat(layer) for layer in zip(*(p.deepstack for p in parts), strict=True)),
    )


def assert_same(got: EncodedRows, want: EncodedRows) -> None:
    assert torch.equal(got.rows, want.rows)
    assert len(got.deepstack) == len(want.deepstack)
    assert all(torch.equal(g, w) for g, w in zip(got.deepstack, want.deepstack, strict=True))


@pytest.mark.parametrize("shape", ["contiguous", "reordered", "alternating"])
async def test_one_request_equals_hand_batch(
    shape: str, processor: Processor, tower: VisionTower
) -> None:
    jobs = shape_jobs(processor, shape, 10)
    jobs.append(jobs[1])  # the same item twice in one request: encoded once
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.0)
    outputs = await engine.encode(jobs)
    want = hand_encode(tower, jobs)
    for job, out in zip(jobs, outputs, strict=True):
        assert not out.cache_hit
        assert_same(out.rows, expected_rows(job, want))
    distinct = len({u.key for j in jobs for u in j.units})
    assert engine.units_encoded == distinct and len(engine.cache) == distinct
    again = await engine.encode(jobs)  # all from the cache now, the same rows
    assert all(o.cache_hit for o in again)
    for a, b in zip(outputs, again, strict=True):
        assert_same(a.rows, b.rows)
    await engine.close()


async def test_concurrent_requests_join_and_split_batches(
    processor: Processor, tower: VisionTower
) -> None:
    first = shape_jobs(processor, "alternating", 20)
    second = [first[3], *shape_jobs(processor, "contiguous", 40)[:2], first[0]]
    largest = max(u.input_rows for j in first + second for u in j.units)
    # A small row budget: each request's misses are split over several entries and batches.
    engine = make_engine(
        tower, EncoderCache(1 << 30), batch_window_s=0.01, max_batch_rows=2 * largest
    )
    a, b = await asyncio.gather(engine.encode(first), engine.encode(second))
    assert engine.batches > 1
    distinct = {u.key for j in first + second for u in j.units}
    assert engine.units_encoded == len(distinct)  # joined, never computed twice
    for jobs, outputs in ((first, a), (second, b)):
        for job, out in zip(jobs, outputs, strict=True):
            # Frames are bit-exact whatever they are batched with; whole images match a
            # call of their own up to the rounding of the batch's row count.
            alone = expected_rows(job, hand_encode(tower, [job]))
            if job.units[0].per_frame:
                assert_same(out.rows, alone)
            else:
                torch.testing.assert_close(out.rows.rows, alone.rows, rtol=1e-5, atol=1e-5)
    assert_same(b[0].rows, a[3].rows)


async def test_calls_of_one_request_are_not_batched_together(
    processor: Processor, tower: VisionTower
) -> None:
    """Two calls with one request id (`router.overlap` sends a video's next piece while
    one encodes) run in two batches, the first answered before the second is encoded;
    other requests' calls queued meanwhile join the first batch, and calls without an id
    batch as before."""
    jobs = [[image_job(processor, 60 + k)] for k in range(4)]
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.05)
    answered: list[str] = []

    async def call(jobs: list[ItemJob], request_id: str, name: str) -> None:
        await engine.encode(jobs, request_id)
        answered.append(name)

    await asyncio.gather(
        call(jobs[0], "r1", "r1 first"),
        call(jobs[1], "r1", "r1 second"),
        call(jobs[2], "r2", "r2"),
    )
    assert engine.batches == 2
    assert answered.index("r1 first") < answered.index("r1 second")
    assert answered.index("r2") < answered.index("r1 second")  # in the first batch
    await asyncio.gather(engine.encode(jobs[3]), engine.encode([image_job(processor, 70)]))
    assert engine.batches == 3  # no ids: one batch
    await engine.close()


# ------------------------------------------------- encode_now, hits, joins, segments


def requests_of(processor: Processor, shape: str, count: int) -> list[list[ItemJob]]:
    return [shape_jobs(processor, shape, 100 * (r + 1)) for r in range(count)]


def assert_as_alone(tower: VisionTower, job: ItemJob, got: EncodedRows) -> None:
    """Rows of `job` equal encoding it alone: bit for bit for frame-by-frame units, up to
    the rounding of the batch's row count for whole images (`VisionTower.encode`)."""
    alone = expected_rows(job, hand_encode(tower, [job]))
    if all(u.per_frame for u in job.units):
        assert_same(got, alone)
    else:
        torch.testing.assert_close(got.stacked, alone.stacked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", ["contiguous", "reordered", "alternating"])
async def test_encode_now_equals_concurrent_encode_and_hand_batch(
    shape: str, processor: Processor, tower: VisionTower
) -> None:
    requests = requests_of(processor, shape, 3)
    requests[2].append(requests[0][1])  # an item of another request: encoded once
    every = [job for jobs in requests for job in jobs]
    want = hand_encode(tower, every)  # one batch of all of them, as both paths make
    now = make_engine(tower, EncoderCache(1 << 30))
    batched = now.encode_now(requests)
    served = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.05)
    concurrent = await asyncio.gather(*(served.encode(jobs) for jobs in requests))
    for engine in (now, served):
        assert engine.batches == 1 and engine.forward_calls == (2 if shape == "alternating" else 1)
        assert engine.units_encoded == len(want) == len(engine.cache)
    for jobs, a, b in zip(requests, batched, concurrent, strict=True):
        for job, x, y in zip(jobs, a, b, strict=True):
            assert not x.cache_hit and not y.cache_hit
            assert_same(x.rows, expected_rows(job, want))
            assert_same(y.rows, x.rows)
            assert_as_alone(tower, job, x.rows)
    await served.close()


async def test_hits_joins_duplicates_and_partitions_in_one_request(
    processor: Processor, tower: VisionTower
) -> None:
    images = [image_job(processor, 300 + k) for k in range(4)]
    videos = [video_job(processor, 400 + k) for k in range(2)]
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.05)
    # Cached before: images 0, 1 and the first partition of video 0.
    some = ItemJob(videos[0].content_hash, (0,), videos[0].units[:1])
    await engine.encode([images[0], images[1], some])
    encoded = engine.units_encoded
    # In flight while the next request arrives: image 2 and video 1.
    other = asyncio.ensure_future(engine.encode([images[2], videos[1]]))
    await asyncio.sleep(0)
    mixed = [images[0], videos[0], images[2], images[3], videos[1], images[3], some]
    outputs = await engine.encode(mixed)
    first = await other
    # Computed once each: the rest of video 0, image 3 (twice asked), image 2 and video 1
    # (joined); nothing cached was encoded again.
    assert engine.units_encoded - encoded == len(videos[0].units) - 1 + 1 + 1 + len(videos[1].units)
    assert [o.cache_hit for o in outputs] == [True, False, False, False, False, False, True]
    for job, out in zip(mixed, outputs, strict=True):
        assert_as_alone(tower, job, out.rows)
    assert_same(outputs[2].rows, first[0].rows)
    assert_same(outputs[4].rows, first[1].rows)
    await engine.close()


def test_small_segments_bound_what_a_cached_unit_keeps(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = requests_of(processor, "alternating", 2)
    every = [job for jobs in requests for job in jobs]
    width = tower.config.out_hidden_size * 4 * (1 + len(tower.config.deepstack_visual_indexes))
    largest = max(u.output_rows for j in every for u in j.units)
    monkeypatch.setattr(batch, "SEGMENT_BYTES", 2 * largest * width)
    engine = make_engine(tower, EncoderCache(1 << 30))
    outputs = engine.encode_now(requests)
    want = hand_encode(tower, every)
    for jobs, outs in zip(requests, outputs, strict=True):
        for job, out in zip(jobs, outs, strict=True):
            assert_same(out.rows, expected_rows(job, want))
    entries = [engine.cache.get(key) for key in want]
    assert all(e is not None for e in entries)
    owners = {id(o): o for o in (e.owner or e for e in entries if e is not None)}
    assert len(owners) > 2  # several segments per mode
    assert all(o.nbytes <= 2 * largest * width for o in owners.values())
    assert engine.cache.bytes_used == sum(o.nbytes for o in owners.values())


async def test_encode_now_refuses_while_encode_has_work_queued(
    processor: Processor, tower: VisionTower
) -> None:
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.05)
    pending = asyncio.ensure_future(engine.encode([image_job(processor, 500)]))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="encode_now"):
        engine.encode_now([[image_job(processor, 501)]])
    await pending
    assert len(engine.encode_now([[image_job(processor, 501)]])[0]) == 1
    await engine.close()


async def test_cancelled_request_leaves_the_joined_one_its_rows(
    processor: Processor, tower: VisionTower
) -> None:
    job = image_job(processor, 600)
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.05)
    first = asyncio.ensure_future(engine.encode([job]))
    second = asyncio.ensure_future(engine.encode([job]))
    await asyncio.sleep(0)
    assert engine.waiting_requests() == 2  # both wait for the one queued unit
    first.cancel()
    (out,) = await second
    assert engine.waiting_requests() == 0
    assert first.cancelled() and engine.units_encoded == 1 and job.units[0].key in engine.cache
    assert_as_alone(tower, job, out.rows)
    await engine.close()


async def test_failed_forward_fails_its_requests_and_caches_nothing(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = [image_job(processor, 700), image_job(processor, 701)]
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.05)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("tower broke")

    monkeypatch.setattr(engine.tower, "encode", broken)
    results = await asyncio.gather(
        engine.encode(jobs[:1]), engine.encode(jobs), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    assert len(engine.cache) == 0 and not engine._inflight
    with pytest.raises(RuntimeError, match="tower broke"):
        engine.encode_now([jobs])
    assert len(engine.cache) == 0 and not engine._inflight and not engine._queue
    monkeypatch.undo()
    (outs,) = engine.encode_now([jobs])
    assert [o.cache_hit for o in outs] == [False, False]
    await engine.close()


async def test_a_failed_batch_drops_the_requests_work_still_queued(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = [image_job(processor, 710), image_job(processor, 711)]
    rows = jobs[0].units[0].input_rows
    # One item a batch: the request's misses are two queued entries.
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.05, max_batch_rows=rows)
    calls = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("tower broke")

    monkeypatch.setattr(engine.tower, "encode", broken)
    with pytest.raises(RuntimeError, match="tower broke"):
        await engine.encode(jobs)
    await asyncio.sleep(0.2)  # past another batch window
    # The second item was not encoded for a request that had already failed.
    assert len(calls) == 1 and engine.units_abandoned == 1
    assert not engine._queue and not engine._inflight and len(engine.cache) == 0
    await engine.close()


async def test_codes_and_older_routers_values_in_one_batch(
    processor: Processor, tower: VisionTower
) -> None:
    """A rolling upgrade's batch: one image's uint8 codes and another's float32 values (as a
    router from before codes sends them, keyed by their own hash) encode as each would
    alone, and the two forms of one image are two keys with the same rows."""
    codes_job = image_job(processor, 70)
    (unit,) = codes_job.units
    values = as_patch_values(unit.pixels, pixel_settings())
    key = content_hash(pixel_settings().fingerprint(), "image", values, unit.grid)
    assert key != unit.key  # the dtype is hashed: codes and values never share a key
    values_job = ItemJob(key, (), (Unit(key, values, unit.grid, False, unit.output_rows),))
    other = image_job(processor, 71)
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.0)
    got = engine.encode_now([[codes_job, values_job, other]])[0]
    want = hand_encode(tower, [codes_job, other])
    assert_same(got[0].rows, want[unit.key])
    assert_same(got[2].rows, want[other.units[0].key])
    assert torch.allclose(got[1].rows.stacked, got[0].rows.stacked, atol=1e-5)
    assert len(engine.cache) == 3


def test_codes_need_the_processor_settings(processor: Processor, tower: VisionTower) -> None:
    engine = EncoderEngine(tower, EncoderCache(1 << 30))
    with pytest.raises(ValueError, match="processor settings"):
        engine.encode_now([[image_job(processor, 72)]])
    assert len(engine.cache) == 0
