"""The router's answers when its drain runs out of time: each ends with an error that says
so (UNAVAILABLE, `STOPPING`; an HTTP stream's last event, then its end), not with gRPC's
"Cancelling all calls" or an HTTP body cut short, and the router's log without tracebacks
(s42 operator review: a rollout restart's router cut its streams after `drain_timeout_s`).

The drain's timeout hook (`ServerLifecycle.on_timeout`) sets `now`; each answer checks it
between chunks (`check`), so a streaming answer ends at its next chunk; the hook then waits
up to `grace_s` for the answers to end before the stop cancels what is left (an answer
still waiting for its first chunk)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from common.server.lifecycle import ServerLifecycle
from router.calls import RouterError

STOPPING = (
    "the router is stopping (its drain_timeout_s ran out before this answer ended); "
    "send the request again"
)


class Stopping:
    """Ends a router's answers once its drain's time ran out (module docstring)."""

    def __init__(self, lifecycle: ServerLifecycle, grace_s: float = 1.0) -> None:
        self.lifecycle = lifecycle
        self.grace_s = grace_s
        self.now = False  # the drain's time ran out: answers end at their next chunk
        lifecycle.on_timeout.append(self.end)

    async def end(self) -> None:
        """Have every answer end at its next chunk, and wait up to `grace_s` for them."""
        self.now = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.grace_s):
                while self.lifecycle.active:
                    await asyncio.sleep(0.02)

    def check(self) -> None:
        """Raise RouterError (UNAVAILABLE, `STOPPING`) once the answers are to end."""
        if self.now:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, STOPPING)
