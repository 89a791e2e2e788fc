"""A worker's readiness (gRPC health "") follows its registrations with the routers, through
the real registrar and the router's real `RegistryService`: not ready before a router
accepts it, ready while one does, not ready again once every router has refused it or been
unreachable for a few heartbeats, ready again on the next acceptance; never ready while
draining. Liveness says SERVING throughout (a pod is not restarted for any of it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server.lifecycle import ServerLifecycle
from common.server.role import RoleServer
from common.server.rpc import LIVENESS_SERVICE, RunningServer, channel, start_server
from common.settings.base import WorkerSettings
from common.settings.security import SecuritySettings
from epd.v1 import registry_service_pb2, registry_service_pb2_grpc
from router.registry import Registry
from router.registry_service import RegistryServicer
from tests.cluster import free_port
from tests.test_registrar import FakeRegistry, _info, _start_registry

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Recording(RoleServer[object]):
    """A role server that records every readiness it reports."""

    reported: list[bool]

    async def set_serving(self, serving: bool) -> None:
        self.reported.append(serving)
        await super().set_serving(serving)


async def _router(port: int, model: str) -> RunningServer:
    """The router's RegistryService over a real registry that takes workers of `model`."""
    registry = Registry(worker_timeout_s=5.0, heartbeat_interval_s=0.05, expected_model=model)
    return await start_server(
        [
            lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(
                RegistryServicer(registry), s
            )
        ],
        port=port,
    )


@pytest.fixture
async def worker() -> AsyncIterator[Recording]:
    settings = WorkerSettings(port=0, security=SecuritySettings(insecure=True))
    server = await Recording.start(
        settings, object(), lambda servicer, s: None, ["epd.v1.Test"], lifecycle=ServerLifecycle()
    )
    server.reported = []
    try:
        yield server
    finally:
        await server.stop(0)


async def _health(server: RunningServer, service: str = "") -> int:
    async with channel(server.address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service)
        )
        return int(reply.status)


async def _until_health(server: RunningServer, status: int, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while await _health(server) != status:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


def _register(worker: Recording, router: str, info: registry_service_pb2.WorkerInfo) -> None:
    """`worker` registers with `router`, with small timings: a router that has not accepted
    it for 3 heartbeats (at most 0.05 s here) + the RPC deadline (0.3 s) no longer counts."""
    load = registry_service_pb2.WorkerLoad
    worker.register(router, info, load, rpc_timeout_s=0.3, retry_initial_s=0.02, retry_max_s=0.1)


def _worker_info() -> registry_service_pb2.WorkerInfo:
    info = _info()
    info.model = "m"
    return info


async def test_readiness_follows_whether_a_router_accepts_the_worker_now(
    worker: Recording,
) -> None:
    # It was latched: once a router had accepted the worker it stayed Ready for good, also
    # when its routers came back with a rotated token or another model, or not at all.
    port = free_port()
    _register(worker, f"127.0.0.1:{port}", _worker_info())
    router: RunningServer | None = None
    try:
        await asyncio.sleep(0.3)  # no router yet
        assert await _health(worker) == NOT_SERVING
        assert await _health(worker, "epd.v1.Test") == NOT_SERVING
        router = await _router(port, "m")
        await _until_health(worker, SERVING)

        await router.stop(0)  # the router is gone: the worker is not ready a moment later
        router = None
        await _until_health(worker, NOT_SERVING)
        assert await _health(worker, LIVENESS_SERVICE) == SERVING  # alive: not restarted

        router = await _router(port, "another")  # back, refusing the worker
        await asyncio.sleep(1.0)  # many refused registrations
        assert await _health(worker) == NOT_SERVING
        assert worker.registrar is not None
        assert worker.registrar.registrars[0].registrations == 1  # only the first
        await router.stop(0)

        router = await _router(port, "m")  # accepts it again: ready again
        await _until_health(worker, SERVING)
        assert worker.reported == [False, True, False, True]
        assert await _health(worker, LIVENESS_SERVICE) == SERVING
    finally:
        if router is not None:
            await router.stop(0)


async def test_a_failed_heartbeat_answered_by_a_new_registration_keeps_it_ready(
    worker: Recording,
) -> None:
    fake = FakeRegistry()  # heartbeats every 20 ms
    router = await _start_registry(fake)
    try:
        _register(worker, router.address, _info())
        await _until_health(worker, SERVING)
        fake.fail_heartbeats = 1  # one heartbeat fails: the worker registers again at once
        while len(fake.registered) < 2:
            await asyncio.sleep(0.01)
        fake.known.clear()  # the router forgot it: it registers again
        while len(fake.registered) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)  # longer than the 0.45 s a router's acceptance lasts
        assert await _health(worker) == SERVING
        assert worker.reported == [False, True]  # never flipped
    finally:
        await router.stop(0)


async def test_a_draining_worker_is_not_ready_while_a_router_accepts_it(
    worker: Recording,
) -> None:
    fake = FakeRegistry()
    router = await _start_registry(fake)
    try:
        _register(worker, router.address, _info())
        await _until_health(worker, SERVING)
        held = [1]  # a lease a peer still holds: the drain waits for it
        worker.lifecycle.holds.append(lambda: held[0])
        drained = asyncio.create_task(worker.lifecycle.drain(timeout_s=5))
        await _until_health(worker, NOT_SERVING)
        heartbeats = len(fake.loads)
        await asyncio.sleep(0.5)  # the router still answers its heartbeats
        assert len(fake.loads) > heartbeats
        assert await _health(worker) == NOT_SERVING
        assert worker.reported[-1] is False
        held[0] = 0
        assert await drained is True
    finally:
        await router.stop(0)
