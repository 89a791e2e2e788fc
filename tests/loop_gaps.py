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
    runs (the list fills as it runs; `max(gaps, default=0.0)` is the longest stall), less
    the time the loop's thread was ready to run but waited for a core: a machine busy with
    other processes is no stall of the loop's own (a 0.47 s gap where 0.3 s is the bound,
    with reviewers' load beside the suite). Waiting on the GIL or on I/O still counts."""
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            before, waited = time.monotonic(), _runqueue_s()
            await asyncio.sleep(period_s)
            gaps.append(time.monotonic() - before - (_runqueue_s() - waited))

    ticker = asyncio.ensure_future(tick())
    try:
        yield gaps
    finally:
        ticker.cancel()


def _runqueue_s() -> float:
    """Seconds this thread has waited on a run queue (Linux schedstat), 0.0 elsewhere."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
