"""A server's lifecycle: starting -> serving -> draining -> stopped, and serving until a
signal.

Every role (router and workers) has one `ServerLifecycle`. Its handlers wrap their bodies in
`track()`, so draining refuses new work (UNAVAILABLE "draining") while in-flight work
finishes; `drain()` ends by stopping the attached server, which for a role server is the
ordered stop of `common.server.role.RoleServer`. `run_until_signal` ties it together for the
`python -m <role>` entry points.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from common.server.rpc import WorkerDrainingError

if TYPE_CHECKING:
    from common.server.rpc import RunningServer

logger = logging.getLogger(__name__)

ON_TIMEOUT_S = 2.0  # the most a drain's `on_timeout` hooks take, all of them


class LifecycleState(enum.StrEnum):
    """Where a server is in its life; see ServerLifecycle."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class ServerLifecycle:
    """A server's lifecycle (router or worker): starting → serving → draining → stopped.

    - starting: created; the model may still load. `track()` already admits work (the
      server is not reachable before `attach`).
    - serving: `attach(running)` was called; health SERVING.
    - draining: `drain()` began; health NOT_SERVING, `track()` refuses new work with
      UNAVAILABLE "draining" (via `rpc_errors`), the `on_drain` hooks run (a worker tells its
      routers at once), tracked in-flight RPCs run to the end and the `holds` (leases held
      for peers) reach zero.
    - stopped: in-flight work finished (or the timeout passed and it was cancelled) and the
      gRPC server is stopped.

    States only move forward. One lifecycle per server.
    """

    def __init__(self) -> None:
        self.state = LifecycleState.STARTING
        self.running: RunningServer | None = None
        self.active = 0  # tracked RPCs in flight
        self._idle = asyncio.Event()
        self._idle.set()
        # Awaited, in order, when draining begins (failures logged): e.g. heartbeat the routers.
        self.on_drain: list[Callable[[], Awaitable[object]]] = []
        # Counts of untracked work a drain also waits for (e.g. leases peers still pull).
        self.holds: list[Callable[[], int]] = []
        # Awaited, in order, when a drain's time ran out, before the stop cancels what is
        # left (failures logged; `ON_TIMEOUT_S` in all): e.g. the router ends its answers
        # with an error that says why, not gRPC's "Cancelling all calls" or a cut body.
        self.on_timeout: list[Callable[[], Awaitable[object]]] = []
        self._drain_task: asyncio.Future[bool] | None = None  # the drain, once begun
        self._stop_task: asyncio.Future[None] | None = None  # the server's stop after it

    @property
    def draining(self) -> bool:
        """True once draining began (also when stopped): no new work."""
        return self.state in (LifecycleState.DRAINING, LifecycleState.STOPPED)

    def attach(self, running: RunningServer) -> None:
        """Bind the started server; it is now serving."""
        self.running = running
        if self.state == LifecycleState.STARTING:
            self.state = LifecycleState.SERVING

    @contextlib.asynccontextmanager
    async def track(self) -> AsyncIterator[None]:
        """Count one in-flight RPC; raises WorkerDrainingError once draining.

        Wrap the whole handler body (for a stream: the whole generator) in it.
        """
        if self.draining:
            raise WorkerDrainingError()
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    def held(self) -> int:
        """Untracked work still held (sum of `holds`; a failing count counts as none)."""
        total = 0
        for count in self.holds:
            try:
                total += count()
            except Exception:
                logger.exception("a drain hold count failed")
        return total

    async def _until_idle(self, poll_s: float = 0.05) -> None:
        await self._idle.wait()
        while self.held() > 0:
            await asyncio.sleep(poll_s)
            await self._idle.wait()

    async def drain(self, timeout_s: float = 300.0, *, stop: bool = True) -> bool:
        """Stop taking work, run `on_drain`, wait up to `timeout_s` for in-flight RPCs and
        `holds`, stop the server (`stop` False: the caller stops it later; meanwhile what
        is not work, such as registrations and heartbeats, is still answered).

        Returns True when every tracked RPC finished in time (False: the rest were cancelled
        by the server stop). The drain runs once, within the first call's `timeout_s`: a
        call while it runs, or after it, waits for it and returns its outcome (stopping the
        server unless `stop` is False; the stop also runs once, every such call returning
        once it is done), and one after the server stopped returns True at once. A caller
        cancelled meanwhile leaves the drain running; a drain or stop that failed (or was
        cancelled) is run again by the next call. Called from within the stop (a cleanup
        step), it returns at once.
        """
        if self.state == LifecycleState.STOPPED:
            return True
        if _to_start(self._drain_task):
            self._drain_task = asyncio.ensure_future(self._drain(timeout_s, stop))
        assert self._drain_task is not None
        clean = await asyncio.shield(self._drain_task)
        if not stop or asyncio.current_task() is self._stop_task:
            return clean
        if _to_start(self._stop_task):
            self._stop_task = asyncio.ensure_future(self._stop(clean))
        assert self._stop_task is not None
        await asyncio.shield(self._stop_task)
        return clean

    async def _stop(self, clean: bool) -> None:
        if self.running is not None:
            # Only untracked RPCs (health watches, releases) can remain: short grace.
            await self.running.stop(grace_s=0.5 if clean else 0.0)
        self.state = LifecycleState.STOPPED
        logger.info("stopped")

    async def _drain(self, timeout_s: float, stop: bool) -> bool:
        """`drain`'s drain: no new work, the hooks, in-flight work waited for."""
        self.state = LifecycleState.DRAINING
        if self.running is not None:
            try:
                await self.running.set_serving(False)
            except Exception:  # health says SERVING a while longer; no work is taken
                logger.exception("setting health NOT_SERVING failed")
        logger.info("draining: %d in flight, %d held", self.active, self.held())
        try:
            async with asyncio.timeout(timeout_s):
                await _run(self.on_drain, "a drain hook")
                await self._until_idle()
            clean = True
        except TimeoutError:
            logger.warning(
                "drain timeout after %.1fs; %s %d RPCs (%d held)",
                timeout_s,
                "cancelling" if stop else "the stop cancels",
                self.active,
                self.held(),
            )
            clean = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ON_TIMEOUT_S):
                    await _run(self.on_timeout, "a drain timeout hook")
        return clean


async def _run(hooks: Sequence[Callable[[], Awaitable[object]]], what: str) -> None:
    """Await each of `hooks` in order; one that fails is logged as `what`, the rest run."""
    for hook in hooks:
        try:
            await hook()
        except Exception:
            logger.exception("%s failed", what)


def _to_start(task: asyncio.Future[Any] | None) -> bool:
    """Whether `task` is to be (re)started: never started, or ended failed or cancelled."""
    return task is None or (task.done() and (task.cancelled() or task.exception() is not None))


async def run_until_signal(
    lifecycle: ServerLifecycle,
    *,
    drain_timeout_s: float = 300.0,
    cleanup: Sequence[Callable[[], Awaitable[None]]] = (),
) -> None:
    """Serve until SIGTERM/SIGINT (or the server stops), then drain gracefully and clean up.

    For `__main__`s: stop taking work, let in-flight work finish (up to `drain_timeout_s`),
    stop the server, then await each `cleanup` (e.g. `registrar.stop`) in order. A second
    signal while draining is ignored (the drain timeout bounds shutdown).
    """
    if lifecycle.running is None:
        raise RuntimeError("run_until_signal needs an attached server")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    waiters = [
        asyncio.ensure_future(stop.wait()),
        asyncio.ensure_future(lifecycle.running.wait_for_termination()),
    ]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        logger.info("shutting down")
        await lifecycle.drain(drain_timeout_s)
    finally:
        for waiter in waiters:
            waiter.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
        for step in cleanup:
            try:
                await step()
            except Exception:
                logger.exception("cleanup step failed")
