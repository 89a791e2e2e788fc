"""A cancelled `EncoderEngine.encode` call: work queued for it alone leaves the queue
unencoded (a caller that sends requests and cancels them cannot queue the tower's work past
what admission lets it hold), while work another request joined, or that the tower has
begun, is still computed and cached; the same content asked again later is encoded afresh."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import Processor
from encoder_worker.cache import EncoderCache
from encoder_worker.engine import EncoderEngine
from tests.test_encoder_engine import assert_as_alone, image_job, make_engine, tower

__all__ = ["tower"]  # the module fixture shared with test_encoder_engine


class Gate:
    """Holds the tower's first forward until opened (the batch is taken meanwhile)."""

    def __init__(self, tower: VisionTower) -> None:
        self.tower = tower
        self.entered = threading.Event()
        self.open = threading.Event()
        self.encode_of = tower.encode

    def encode(self, *args: object, **kwargs: object) -> object:
        self.entered.set()
        self.open.wait(10)
        return self.encode_of(*args, **kwargs)  # type: ignore[arg-type]


def gated(tower: VisionTower, monkeypatch: pytest.MonkeyPatch) -> tuple[EncoderEngine, Gate]:
    """An engine (no batching window) whose tower holds its first forward until opened."""
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.0)
    gate = Gate(tower)
    monkeypatch.setattr(engine.tower, "encode", gate.encode)
    return engine, gate


async def test_work_queued_for_cancelled_requests_alone_is_not_encoded(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, gate = gated(tower, monkeypatch)
    running = asyncio.ensure_future(engine.encode([image_job(processor, 800)]))
    await asyncio.to_thread(gate.entered.wait, 10)  # the tower holds the first batch
    abandoned = [image_job(processor, 801 + k) for k in range(3)]
    gone = [asyncio.ensure_future(engine.encode([job])) for job in abandoned]
    shared = image_job(processor, 810)
    left = asyncio.ensure_future(engine.encode([shared]))  # queued, then joined
    joined = asyncio.ensure_future(engine.encode([shared]))
    await asyncio.sleep(0)
    assert len(engine._queue) == 4
    for task in (*gone, left):
        task.cancel()
    await asyncio.sleep(0)
    assert len(engine._queue) == 1 and engine.units_abandoned == 3  # the shared one stays
    assert all(job.units[0].key not in engine._inflight for job in abandoned)
    gate.open.set()
    await running
    (out,) = await joined
    assert_as_alone(tower, shared, out.rows)
    assert engine.units_encoded == 2 and all(t.cancelled() for t in (*gone, left))
    assert all(job.units[0].key not in engine.cache for job in abandoned)
    (again,) = await asyncio.wait_for(engine.encode([abandoned[0]]), 10)  # asked again: encoded
    assert not again.cache_hit and engine.units_encoded == 3
    assert_as_alone(tower, abandoned[0], again.rows)
    await engine.close()


async def test_a_request_cancelled_once_the_tower_took_it_is_still_cached(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, gate = gated(tower, monkeypatch)
    job = image_job(processor, 820)
    task = asyncio.ensure_future(engine.encode([job]))
    await asyncio.to_thread(gate.entered.wait, 10)
    task.cancel()
    await asyncio.sleep(0)
    gate.open.set()
    for _ in range(500):  # the batch finishes on its worker thread
        if job.units[0].key in engine.cache:
            break
        await asyncio.sleep(0.01)
    assert job.units[0].key in engine.cache and engine.units_abandoned == 0
    (out,) = await engine.encode([job])
    assert out.cache_hit
    await engine.close()
