"""The worker's `Registrar` against a fake router's RegistryService over real gRPC: it
registers, heartbeats its load, registers again when forgotten, waits for a router that is
not up yet, comes back soon after a router's return, and logs refusals and failures
at the level an operator needs."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
from typing import Any

import grpc
import pytest

from common.roles import EMBEDDING_DIGESTS, PATCH_CODES, PROTOCOL_VERSION
from common.server.registrar import Registrar
from common.server.rpc import RunningServer, start_server
from epd.v1 import registry_service_pb2, registry_service_pb2_grpc


class FakeRegistry(registry_service_pb2_grpc.RegistryServiceServicer):
    """Records registrations and heartbeats; can forget workers or fail heartbeats."""

    def __init__(self) -> None:
        self.registered: list[registry_service_pb2.WorkerInfo] = []
        self.loads: list[registry_service_pb2.WorkerLoad] = []
        self.known: set[str] = set()
        self.fail_heartbeats = 0

    async def Register(self, request: Any, context: Any) -> Any:
        self.registered.append(request.worker)
        worker_id = f"w{len(self.registered)}"
        self.known.add(worker_id)
        return registry_service_pb2.RegisterResponse(worker_id=worker_id, heartbeat_interval_ms=20)

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        if self.fail_heartbeats > 0:
            self.fail_heartbeats -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router restarting")
        self.loads.append(request.load)
        return registry_service_pb2.HeartbeatResponse(known=request.worker_id in self.known)


async def _start_registry(fake: FakeRegistry, port: int = 0) -> RunningServer:
    return await start_server(
        [lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(fake, s)],
        port=port,
    )


def _info() -> registry_service_pb2.WorkerInfo:
    return registry_service_pb2.WorkerInfo(
        role=registry_service_pb2.WORKER_ROLE_ENCODER,
        address="127.0.0.1:1",
        protocol_version=PROTOCOL_VERSION,
        capabilities=["nixl", PATCH_CODES, EMBEDDING_DIGESTS],
        name="enc-0",
    )


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


async def test_registrar_registers_heartbeats_and_reregisters() -> None:
    fake = FakeRegistry()
    router = await _start_registry(fake)
    calls = 0

    def load() -> registry_service_pb2.WorkerLoad:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("load_fn bug must not stop heartbeats")
        return registry_service_pb2.WorkerLoad(active_requests=calls, cache_hits=7)

    registrar = Registrar(router.address, _info(), load, retry_initial_s=0.01)
    try:
        registrar.start()
        assert await registrar.wait_registered(5) == "w1"
        assert fake.registered[0].capabilities == ["nixl", PATCH_CODES, EMBEDDING_DIGESTS]
        assert fake.registered[0].protocol_version == "epd.v1"
        await _until(lambda: len(fake.loads) >= 3)
        assert fake.loads[0].cache_hits == 7
        assert fake.loads[1] == registry_service_pb2.WorkerLoad()  # load_fn raised

        fake.known.clear()  # router forgot us: next heartbeat says known=False
        await _until(lambda: registrar.registrations == 2)
        assert registrar.worker_id == "w2"

        fake.fail_heartbeats = 2  # router unreachable for a while
        await _until(lambda: registrar.registrations == 3)
        assert registrar._task is not None and not registrar._task.done()
    finally:
        await registrar.stop()
        await router.stop(0)


async def test_registrar_sends_its_load_as_soon_as_it_registers() -> None:
    # The first heartbeat waited a whole interval: till then the router's admission had no
    # KV capacity for the worker (it placed requests there unaccounted) and `epd status`
    # showed its KV as 0/0.
    class SlowHeartbeats(FakeRegistry):
        async def Register(self, request: Any, context: Any) -> Any:
            reply = await super().Register(request, context)
            reply.heartbeat_interval_ms = 60_000
            return reply

    fake = SlowHeartbeats()
    router = await _start_registry(fake)
    load = registry_service_pb2.WorkerLoad(kv_blocks_free=64)
    registrar = Registrar(router.address, _info(), lambda: load)
    try:
        registrar.start()
        await registrar.wait_registered(5)
        await _until(lambda: len(fake.loads) == 1, timeout_s=2.0)
        assert fake.loads[0].kv_blocks_free == 64
    finally:
        await registrar.stop()
        await router.stop(0)


async def test_registrar_waits_for_router_to_appear() -> None:
    probe_server = await start_server([])
    port = int(probe_server.address.rsplit(":", 1)[1])
    await probe_server.stop(0)

    fake = FakeRegistry()
    registrar = Registrar(
        f"127.0.0.1:{port}",
        _info(),
        registry_service_pb2.WorkerLoad,
        retry_initial_s=0.02,
        retry_max_s=0.05,
        rpc_timeout_s=0.5,
    )
    registrar.start()
    router = None
    try:
        await asyncio.sleep(0.2)
        assert registrar.registrations == 0
        assert registrar._task is not None and not registrar._task.done()
        assert registrar.failing.startswith("UNAVAILABLE: ")  # what `epd serve` tells
        router = await _start_registry(fake, port=port)
        assert await registrar.wait_registered(5) == "w1"
        assert registrar.failing == ""
    finally:
        await registrar.stop()
        if router is not None:
            await router.stop(0)


async def test_a_worker_registers_again_soon_after_its_router_comes_back() -> None:
    # gRPC's reconnect back-off grows to 120 s while a router is down (and the registrar's
    # own to 5 s): after a 4 s outage workers came back seconds late (a restarted router had
    # no encoder or decode worker meanwhile); after a few minutes' outage, up to two minutes.
    fake = FakeRegistry()
    router = await _start_registry(fake)
    port = int(router.address.rsplit(":", 1)[1])
    registrar = Registrar(router.address, _info(), registry_service_pb2.WorkerLoad)  # defaults
    registrar.start()
    try:
        await registrar.wait_registered(5)
        await router.stop(0)
        await asyncio.sleep(4.0)  # down: every retry fails
        router = await _start_registry(fake, port=port)
        back = time.monotonic()
        await _until(lambda: registrar.registrations == 2, 10)
        # Its back-off is at most a second; 3 s leaves room on a loaded machine (1.51 s
        # once, beside three other test runs), short of the 5 s back-off it replaced.
        assert time.monotonic() - back < 3.0
    finally:
        await registrar.stop()
        await router.stop(0)


async def test_a_refused_registration_is_logged_with_its_reason_on_both_sides(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The worker logged only the status code, once; the router nothing at all for an
    # incomplete registration (and `epd status` never listed it).
    from router.registry import Registry
    from router.registry_service import RegistryServicer

    registry = Registry(worker_timeout_s=5.0, heartbeat_interval_s=1.0, expected_model="m")
    router = await start_server(
        [
            lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(
                RegistryServicer(registry), s
            )
        ]
    )
    wrong = _info()
    wrong.model = "another"
    incomplete = _info()
    incomplete.address = "10.0.0.5"  # no port
    try:
        for info, why in ((wrong, "serves model 'another'"), (incomplete, "is not an address")):
            caplog.clear()
            registrar = Registrar(router.address, info, registry_service_pb2.WorkerLoad)
            registrar.start()
            # The worker's own line (waiting for any, the router's came first on a loaded
            # machine and the registrar was stopped before it logged).
            await _until(
                lambda why=why: any(
                    why in r.getMessage() and r.name == "common.server.registrar"
                    for r in caplog.records
                )
            )
            await registrar.stop()
            assert any(why in reason for reason in registry.refusals.values()), why
    finally:
        await router.stop(0)


async def test_a_draining_workers_failed_heartbeat_is_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An orderly `epd serve` stop drains the workers, then stops the routers first: each
    # worker logged a WARNING that its heartbeat failed. A serving worker still warns.
    for draining, level in ((True, logging.DEBUG), (False, logging.WARNING)):
        fake = FakeRegistry()
        router = await _start_registry(fake)
        load = registry_service_pb2.WorkerLoad(draining=draining)
        registrar = Registrar(router.address, _info(), functools.partial(copy.copy, load))
        registrar.start()
        try:
            await registrar.wait_registered(5)
            await _until(lambda fake=fake: bool(fake.loads))
            fake.fail_heartbeats = 1_000  # every one from now (the loop's own too)
            caplog.clear()
            caplog.set_level(logging.DEBUG, logger="common.server.registrar")
            assert not await registrar.heartbeat_now()
            failed = [r for r in caplog.records if "heartbeat with router" in r.getMessage()]
            assert failed and failed[0].levelno == level, draining  # the rest: debug anyway
        finally:
            await registrar.stop()
            await router.stop(0)
