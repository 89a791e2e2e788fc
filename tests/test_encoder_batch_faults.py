"""A batch of `EncoderEngine` that fails after the tower's forward, while its rows are
cached: its requests get the error and the engine goes on encoding. It stopped the batch
loop, and the batch's requests waited for their deadlines (races review L4, s45); in
`encode_now` its keys stayed in flight, every later call refused (ownfixB F3, s45)."""

from __future__ import annotations

import asyncio

import pytest

from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import Processor
from encoder_worker.cache import EncoderCache
from encoder_worker.engine import EncoderEngine
from tests.test_encoder_engine import image_job, make_engine, tower

__all__ = ["tower"]  # the module fixture shared with test_encoder_engine


def cache_broken(tower: VisionTower, monkeypatch: pytest.MonkeyPatch) -> EncoderEngine:
    """An engine whose cache raises at every store (until `monkeypatch.undo()`)."""
    engine = make_engine(tower, EncoderCache(1 << 30), batch_window_s=0.0)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cache broke")

    monkeypatch.setattr(engine.cache, "put_many", broken)
    return engine


async def test_a_batch_that_fails_caching_fails_its_requests_and_the_next_is_encoded(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = cache_broken(tower, monkeypatch)
    async with asyncio.timeout(30):
        with pytest.raises(RuntimeError, match="cache broke"):
            await engine.encode([image_job(processor, 800)])
        assert not engine._inflight and not engine._running
        monkeypatch.undo()
        (out,) = await engine.encode([image_job(processor, 801)])
    assert not out.cache_hit and engine.units_encoded == 1
    await engine.close()


def test_encode_now_that_fails_caching_leaves_nothing_in_flight(
    processor: Processor, tower: VisionTower, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = cache_broken(tower, monkeypatch)
    with pytest.raises(RuntimeError, match="cache broke"):
        engine.encode_now([[image_job(processor, 810)]])
    assert not engine._inflight and not engine._queue
    monkeypatch.undo()
    (outs,) = engine.encode_now([[image_job(processor, 810)]])
    assert [o.cache_hit for o in outs] == [False]
