"""The threads that prepare requests off the router's event loop, and who may use them.

Preparing a request can take a long time: its media URLs are fetched (up to
`http_fetch_timeout_s` each) and its media decoded, a video file for as long as
`max_video_decoded_pixels` allows (tens of seconds of a core). On the event loop's default
executor (`min(32, cores + 4)` threads, first come first served, shared with everything
else the router hands a thread) eight slow videos of one tenant made every later request
wait behind them: a one-token text request of another tenant took 84 s. So there are two
pools:

- `heavy` (`min(32, cores + 4)` threads) takes what may be slow: a request with media, the
  conversion of an HTTP body that names media, the parsing of a large body. Where
  `[router] tenant_share` applies, one tenant has at most that share of its threads (at
  least one) busy at once; its other work waits for its own share, so another tenant's
  takes the next free thread.
- `light` (`LIGHT_THREADS`) takes the rest: text-only requests and small bodies, which never
  wait behind a decode.

A cancelled caller stops waiting at once; work already on a thread runs on (the preparation
asks its `ended` callback between items and frames, `router.prepare`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from epd.v1 import router_service_pb2

T = TypeVar("T")

LIGHT_THREADS = 4
LIGHT_BODY_BYTES = 1 << 20  # an HTTP body past this is parsed on `heavy`


def heavy_threads() -> int:
    """The threads of `heavy`: what asyncio's default executor has."""
    return min(32, (os.cpu_count() or 1) + 4)


def has_media(request: router_service_pb2.GenerateRequest) -> bool:
    """Whether any message of `request` holds an image or a video."""
    return any(
        part.WhichOneof("content") in ("image", "video")
        for message in request.messages
        for part in message.content
    )


class PrepareThreads:
    """The `heavy` and `light` pools (module docstring); `tenant_share` 1: no share."""

    def __init__(self, tenant_share: float = 1.0, threads: int | None = None) -> None:
        self.threads = threads or heavy_threads()
        self.heavy = ThreadPoolExecutor(self.threads, thread_name_prefix="epd-prepare")
        self.light = ThreadPoolExecutor(LIGHT_THREADS, thread_name_prefix="epd-prepare-light")
        self.tenant_threads = max(1, int(self.threads * tenant_share)) if tenant_share < 1 else 0
        self._of: dict[str, _TenantThreads] = {}  # tenants with work running or waiting
        # Work on each pool's threads or queued for them (`epd:prepare_pending`).
        self.pending = {"heavy": 0, "light": 0}

    async def run(self, heavy: bool, tenant: str | None, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a thread of `heavy` (within `tenant`'s share) or of `light`, with
        this task's context variables, as `asyncio.to_thread`. A share is held until `fn`
        returns, also when the caller stopped waiting before: a client that hangs up and
        sends again does not get more threads than its share."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        loop = asyncio.get_running_loop()
        pool = "heavy" if heavy else "light"
        self.pending[pool] += 1  # waiting for its tenant's share counts too
        try:
            release = await self._take(tenant) if heavy else _nothing
        except BaseException:
            self.pending[pool] -= 1
            raise
        try:
            work = (self.heavy if heavy else self.light).submit(call)
        except BaseException:
            self.pending[pool] -= 1
            release()
            raise

        def done(_: object) -> None:
            self.pending[pool] -= 1
            release()

        work.add_done_callback(lambda _: loop.call_soon_threadsafe(done, None))
        return await asyncio.wrap_future(work)

    def busy(self, tenant: str) -> int:
        """Threads of `heavy` that `tenant`'s work holds now (with a share; else 0)."""
        mine = self._of.get(tenant)
        return mine.running if mine is not None else 0

    async def _take(self, tenant: str | None) -> Callable[[], None]:
        """One of `tenant`'s share of `heavy` (waiting for it); returns what gives it back."""
        if not self.tenant_threads or tenant is None:
            return lambda: None
        mine = self._of.get(tenant)
        if mine is None:
            mine = self._of[tenant] = _TenantThreads(asyncio.Semaphore(self.tenant_threads))
        mine.users += 1
        try:
            await mine.slots.acquire()
        except BaseException:
            self._leave(tenant, mine)
            raise
        mine.running += 1

        def release() -> None:
            mine.running -= 1
            mine.slots.release()
            self._leave(tenant, mine)

        return release

    def _leave(self, tenant: str, mine: _TenantThreads) -> None:
        mine.users -= 1
        if not mine.users:
            del self._of[tenant]

    async def close(self) -> None:
        """Stop both pools; work not started is dropped, work running finishes alone."""
        self.heavy.shutdown(wait=False, cancel_futures=True)
        self.light.shutdown(wait=False, cancel_futures=True)


def _nothing() -> None:
    pass


@dataclass(slots=True, eq=False)
class _TenantThreads:
    """One tenant's share of `heavy`, while work of it runs or waits."""

    slots: asyncio.Semaphore  # `tenant_threads` of them
    users: int = 0  # calls running or waiting
    running: int = 0  # of those, the ones on a thread
