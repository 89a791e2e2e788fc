"""`EncoderEngine`'s batched input preparation: per-request queue entries and one copied
output segment per request give exactly the rows of the equivalent hand-made tower calls,
in the three shapes of `benchmarks/encoder_input_bench.py`, with joins, duplicates and
`max_batch_rows` splits; the cache counts a shared segment's bytes once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from common.models.qwen3_vl.vision import VisionTower
from common.models.tiny import default_checkpoint
from common.processing.processor import Processor
from encoder_worker.cache import EncodedRows, EncoderCache
from encoder_worker.engine import EncoderEngine
from encoder_worker.requests import ItemJob, Unit
from encoder_worker.server import load_tower
from encoder_worker.settings import EncoderSettings


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return default_checkpoint("tiny")


@pytest.fixture(scope="module")
def processor(ckpt: Path) -> Processor:
    return Processor.from_pretrained(ckpt)


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
            torch.cat([u.pixels for u in chosen]),
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
    engine = EncoderEngine(tower, EncoderCache(1 << 30), batch_window_s=0.0)
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
    engine = EncoderEngine(
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
