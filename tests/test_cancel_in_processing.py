"""A request cancelled while the router processes it on a worker thread (which cannot be
interrupted) holds nothing once the thread is done: the media reservation it would make
after its request went away is refused, not kept (`router.held.MediaHold`)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.sampling import SamplingParams
from tests.test_http_api import add_workers, fake_router


async def test_a_request_cancelled_before_its_media_are_reserved_leaves_nothing_held(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = await fake_router(ckpt)
    await add_workers(c)
    servicer = c.router.servicer
    entered, gate = threading.Event(), threading.Event()
    prepare = servicer._prepare

    def held_up(*args: Any, **kwargs: Any) -> Any:  # the thread starts; its request goes
        entered.set()
        gate.wait(10)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(servicer, "_prepare", held_up)
    picture = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}]}]
    try:
        call = asyncio.ensure_future(c.client.generate_text(messages, SamplingParams(max_tokens=2)))
        await asyncio.to_thread(entered.wait, 10)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        for _ in range(200):  # the request's own bytes come back once the router sees it go
            if servicer.held.held == 0:
                break
            await asyncio.sleep(0.01)
        assert servicer.held.held == 0
        gate.set()  # the orphaned processing goes on to read the image headers
        for _ in range(50):
            await asyncio.sleep(0.02)
            assert servicer.held.held == 0, "an orphaned reservation is held"
    finally:
        gate.set()
        await c.close()
