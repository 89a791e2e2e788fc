"""The threads that prepare requests off the router's event loop, and who may use them.

Preparing a request can take a long time: its media URLs are fetched (up to
`http_fetch_timeout_s` each) and its media decoded, a video file for as long as
`max_video_decoded_pixels` allows (tens of seconds of a core). On the event loop's default
executor (`min(32, cores + 4)` threads, first come first served, shared with everything
else the router hands a thread) eight slow videos of one tenant made every later request
wait behind them: a one-token text request of another tenant took 84 s. So there are two
pools:

- `heavy` (`min(32, cores + 4)` threads) takes what may be slow: a request with media, the
  conversion of an HTTP body that names media, the parsing of a large body.
- `light` (`LIGHT_THREADS`) takes the rest: text-only requests and small bodies, which never
  wait behind a decode.

Where `[router] tenant_share` applies, one tenant has at most that share of each pool's
threads (at least one) busy at once; its other work waits for its own share, so another
tenant's takes the next free thread (a tenant's 32 text prompts of 1 MiB, 0.6-2 s each to
tokenize, held a one-token prompt of another 30 s when only `heavy` was shared).

A cancelled caller stops waiting at once; work already on a thread runs on (the preparation
asks its `ended` callback between items and frames, `router.prepare`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from common.models.malloc_settings import IDLE_RELEASE_S, MEDIA, release_free_memory, tune_malloc
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
        tune_malloc(MEDIA)  # freed media go back to the kernel (before the threads' arenas)
        self.threads = threads or heavy_threads()
        self.pools = {
            "heavy": ThreadPoolExecutor(self.threads, thread_name_prefix="epd-prepare"),
            "light": ThreadPoolExecutor(LIGHT_THREADS, thread_name_prefix="epd-prepare-light"),
        }
        # One tenant's threads of each pool at most (0: no share).
        self.shares = {
            "heavy": max(1, int(self.threads * tenant_share)) if tenant_share < 1 else 0,
            "light": max(1, int(LIGHT_THREADS * tenant_share)) if tenant_share < 1 else 0,
        }
        # (pool, tenant) of work running or waiting for the tenant's share
        self._of: dict[tuple[str, str], _TenantThreads] = {}
        # Work on each pool's threads or queued for them (`epd:prepare_pending`).
        self.pending = {"heavy": 0, "light": 0}
        self._idle: asyncio.TimerHandle | None = None  # `heavy` idle: memory given back then
        self._closed = False

    async def run(self, heavy: bool, tenant: str | None, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a thread of `heavy` or of `light`, within `tenant`'s share of it,
        with this task's context variables, as `asyncio.to_thread`. A share is held until
        `fn` returns, also when the caller stopped waiting before: a client that hangs up
        and sends again does not get more threads than its share."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        loop = asyncio.get_running_loop()
        pool = "heavy" if heavy else "light"
        self.pending[pool] += 1  # waiting for its tenant's share counts too
        try:
            release = await self._take(pool, tenant)
        except BaseException:
            self.pending[pool] -= 1
            raise
        try:
            work = self.pools[pool].submit(call)
        except BaseException:
            self.pending[pool] -= 1
            release()
            raise

        def done(_: object) -> None:
            self.pending[pool] -= 1
            release()
            if pool == "heavy" and not self.pending[pool] and not self._closed:
                if self._idle is not None:
                    self._idle.cancel()
                self._idle = loop.call_later(IDLE_RELEASE_S, self._release_if_idle, loop)

        def finished(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed first (process exit)
                loop.call_soon_threadsafe(done, None)

        work.add_done_callback(finished)
        try:
            return await asyncio.wrap_future(work)
        finally:  # its error's traceback holds this frame: a cycle through the future kept
            del work, call, args  # the request until a garbage collection (attacker2, s40)

    def _release_if_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """What media requests freed, given back once `heavy` stayed idle a while: the heap's
        holes under what lives on are kept by malloc's own trim (`release_free_memory`)."""
        self._idle = None
        if not self.pending["heavy"]:
            loop.run_in_executor(None, release_free_memory)

    def busy(self, tenant: str, pool: str = "heavy") -> int:
        """Threads of `pool` that `tenant`'s work holds now (with a share; else 0)."""
        mine = self._of.get((pool, tenant))
        return mine.running if mine is not None else 0

    async def _take(self, pool: str, tenant: str | None) -> Callable[[], None]:
        """One of `tenant`'s share of `pool` (waiting for it); returns what gives it back."""
        share = self.shares[pool]
        if not share or tenant is None:
            return _nothing
        key = (pool, tenant)
        mine = self._of.get(key)
        if mine is None:
            mine = self._of[key] = _TenantThreads(asyncio.Semaphore(share))
        mine.users += 1
        try:
            await mine.slots.acquire()
        except BaseException:
            self._leave(key, mine)
            raise
        mine.running += 1

        def release() -> None:
            mine.running -= 1
            mine.slots.release()
            self._leave(key, mine)

        return release

    def _leave(self, key: tuple[str, str], mine: _TenantThreads) -> None:
        mine.users -= 1
        if not mine.users:
            del self._of[key]

    async def close(self) -> None:
        """Stop both pools; work not started is dropped, work running finishes alone."""
        self._closed = True
        if self._idle is not None:
            self._idle.cancel()
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


def _nothing() -> None:
    pass


@dataclass(slots=True, eq=False)
class _TenantThreads:
    """One tenant's share of a pool, while work of it runs or waits."""

    slots: asyncio.Semaphore  # the pool's share of them
    users: int = 0  # calls running or waiting
    running: int = 0  # of those, the ones on a thread
