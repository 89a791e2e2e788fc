"""How long the running event loop went without running a ticker, while a block ran: what
one caller's request held it for (the stall tests of the router's front doors)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def loop_gaps(period_s: float = 0.01) -> AsyncIterator[list[float]]:
    """The times between a ticker's wake-ups, one `period_s` sleep each, while the block
    runs (the list fills as it runs; `max(gaps, default=0.0)` is the longest stall)."""
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(period_s)
            gaps.append(time.monotonic() - before)

    ticker = asyncio.ensure_future(tick())
    try:
        yield gaps
    finally:
        ticker.cancel()
