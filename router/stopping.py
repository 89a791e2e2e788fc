"""The router's answers when its drain runs out of time: each ends with an error that says
so (UNAVAILABLE, `STOPPING`; an HTTP stream's last event, then its end; an HTTP answer not
started yet, 503), not with gRPC's "Cancelling all calls", an HTTP body cut short or a 500,
and the router's log without tracebacks (s42 operator review: a rollout restart's router
cut its streams after `drain_timeout_s`).

Each answer runs in the task that sends it under a timeout of its own with no deadline
(`answering`, or `ending` around a timeout it has). The drain's timeout hook
(`ServerLifecycle.on_timeout`, `end`) sets `now` and moves every such deadline to now:
asyncio cancels each task where it waits (for a worker, a chunk, the queue, a slow reader)
and turns the cancel into a TimeoutError, which `answering` makes RouterError(UNAVAILABLE,
`STOPPING`) and an HTTP stream an error event. The hook then waits up to `grace_s` for the
answers to end before the stop cancels what is left. Nothing is added per chunk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

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
        self.now = False  # the drain's time ran out: every answer ends
        self._timeouts: set[asyncio.Timeout] = set()  # of the answers running
        lifecycle.on_timeout.append(self.end)

    async def end(self) -> None:
        """End every answer now, and wait up to `grace_s` for them to be done."""
        self.now = True
        now = asyncio.get_running_loop().time()
        for timeout in list(self._timeouts):
            when = timeout.when()
            if when is None or when > now:  # (it may be ending already)
                timeout.reschedule(now)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.grace_s):
                while self.lifecycle.active:
                    await asyncio.sleep(0.02)

    def seen(self, exc: BaseException) -> BaseException:
        """How an answer that ended with `exc` is counted and logged: ended by the stop,
        not left by its client, once the drain's time ran out (the cancel reaches the
        answer's code before `answering` turns it into RouterError)."""
        if self.now and isinstance(exc, asyncio.CancelledError | GeneratorExit):
            return RouterError(grpc.StatusCode.UNAVAILABLE, STOPPING)
        return exc

    @contextlib.contextmanager
    def ending(self, timeout: asyncio.Timeout) -> Iterator[None]:
        """Within `timeout` (entered by the task that sends the answer), which `end`
        moves to now: its TimeoutError is then the router's stop (`now`)."""
        self._timeouts.add(timeout)
        try:
            yield
        finally:
            self._timeouts.discard(timeout)

    @contextlib.asynccontextmanager
    async def answering(self) -> AsyncIterator[None]:
        """Around an answer, in the task that sends it: ended by `end` with RouterError
        (UNAVAILABLE, `STOPPING`)."""
        try:
            async with asyncio.timeout(None) as timeout:
                with self.ending(timeout):
                    yield
        except TimeoutError:
            if not self.now:
                raise
            raise RouterError(grpc.StatusCode.UNAVAILABLE, STOPPING) from None
