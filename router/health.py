"""The router's gRPC health: SERVING only while every role has a serving worker and the
router is not draining (`Registry.ready`), checked at once when a worker registers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from common.server.lifecycle import ServerLifecycle
from router.registry import Registry


async def health_loop(
    registry: Registry,
    lifecycle: ServerLifecycle,
    set_serving: Callable[[bool], Awaitable[None]],
    period_s: float,
) -> None:
    """Follow the registry every `period_s`, and at each registration, until cancelled; a
    draining router's status is the drain's to set."""
    changed = asyncio.Event()
    registry.on_register.append(lambda _worker: changed.set())
    serving: bool | None = None
    while True:
        changed.clear()  # before the look: a registration during `set_serving` is seen next
        now = not registry.unready() and not lifecycle.draining
        if now != serving and not lifecycle.draining:
            await set_serving(now)
        serving = now
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(period_s):
                await changed.wait()
