"""`ServerLifecycle.drain` on its own (a fake server, and a real one whose gRPC stop fails):
one drain and one stop, whoever calls and however often, a failed step run again, a drain
from within the stop answered at once."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server.lifecycle import LifecycleState, ServerLifecycle
from common.server.rpc import start_server


async def test_two_drains_at_once_drain_once() -> None:
    # A controller's drain(stop=False) and a signal's drain() together ran the hooks
    # twice (ownfixD review); a cancelled caller does not stop the drain either.
    lifecycle = ServerLifecycle()
    ran: list[int] = []

    async def hook() -> None:
        ran.append(1)
        await asyncio.sleep(0.2)

    lifecycle.on_drain.append(hook)
    first = asyncio.create_task(lifecycle.drain(5, stop=False))
    await asyncio.sleep(0.05)
    cancelled = asyncio.create_task(lifecycle.drain(5))
    second = asyncio.create_task(lifecycle.drain(5))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    assert await first is True and await second is True
    assert ran == [1] and lifecycle.state == LifecycleState.STOPPED


class SlowStop:
    """A running server whose health fails once and whose stop takes a while (a fake)."""

    def __init__(self) -> None:
        self.health_failures = 1
        self.stopped = False
        self.stops = 0  # calls of `stop`

    async def set_serving(self, serving: bool) -> None:
        if self.health_failures:
            self.health_failures -= 1
            raise RuntimeError("health is gone")

    async def stop(self, grace_s: float | None = None) -> None:
        self.stops += 1
        await asyncio.sleep(0.2)
        self.stopped = True


async def test_every_drain_returns_once_the_server_stopped_and_a_failed_health_does_not_stick() -> (
    None
):
    # A second caller returned, STOPPED, while the first was still stopping the server; a
    # failure setting health NOT_SERVING was kept, and every later drain raised it
    # (ownfixE review).
    lifecycle = ServerLifecycle()
    running = SlowStop()
    lifecycle.attach(running)  # type: ignore[arg-type]
    first = asyncio.create_task(lifecycle.drain(5))
    second = asyncio.create_task(lifecycle.drain(5))
    assert await second is True and running.stopped
    assert await first is True and lifecycle.state == LifecycleState.STOPPED
    assert running.stops == 1  # the stop ran once, for both (s38diff F5)


async def test_a_stop_that_failed_is_run_again_and_a_drain_from_within_it_returns() -> None:
    # A failed stop was kept: every later drain raised it and never stopped the server; a
    # drain called by a step of the stop waited for that stop (ownfixF review).
    lifecycle = ServerLifecycle()
    running = SlowStop()
    running.health_failures = 0
    calls: list[str] = []
    real_stop = running.stop

    async def stop(grace_s: float | None = None) -> None:
        calls.append("stop")
        if len(calls) == 1:
            raise RuntimeError("stop step failed")
        assert await lifecycle.drain(5) is True  # from within the stop: at once
        await real_stop(grace_s)

    running.stop = stop  # type: ignore[method-assign]
    lifecycle.attach(running)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="stop step failed"):
        await lifecycle.drain(5)
    assert await asyncio.wait_for(lifecycle.drain(5), 5) is True
    assert calls == ["stop", "stop"] and running.stopped
    assert lifecycle.state == LifecycleState.STOPPED


async def test_a_real_servers_failed_stop_is_run_again() -> None:
    # The server's own stop set `stopped` before the gRPC stop failed: the drain's rerun
    # returned at once, and the lifecycle said STOPPED while the server still served
    # (s38diff F4).
    running = await start_server([], host="127.0.0.1", port=0)
    lifecycle = ServerLifecycle()
    lifecycle.attach(running)
    real_stop = running.server.stop
    calls: list[float | None] = []

    async def stop_failing_once(grace_s: float | None) -> None:
        calls.append(grace_s)
        if len(calls) == 1:
            raise RuntimeError("gRPC stop failed")
        await real_stop(grace_s)

    running.server.stop = stop_failing_once
    try:
        with pytest.raises(RuntimeError, match="gRPC stop failed"):
            await lifecycle.drain(1)
        assert not running.stopped
        assert await lifecycle.drain(1) is True
        assert len(calls) == 2 and running.stopped
        assert lifecycle.state == LifecycleState.STOPPED
        async with grpc.aio.insecure_channel(running.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError):  # stopped: nothing answers
                await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=1
                )
    finally:
        await real_stop(0)
