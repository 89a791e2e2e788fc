"""Tests for common.rpc: error mapping, health, draining, channels, and the Registrar."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.kv.block_pool import NoFreeBlocksError
from common.multimodal.validation import MultimodalLayoutError
from common.roles import PROTOCOL_VERSION
from common.server.lifecycle import LifecycleState, ServerLifecycle
from common.server.registrar import Registrar
from common.server.rpc import (
    RpcStatusError,
    RunningServer,
    channel,
    rpc_errors,
    service_name,
    start_server,
    wait_healthy,
)
from common.settings.schema import SettingsError
from epd.v1 import registry_service_pb2, registry_service_pb2_grpc

SERVICE = "test.Probe"

ERRORS: dict[bytes, Exception] = {
    b"layout": MultimodalLayoutError("run_lengths", "runs do not sum to the length", item=1),
    b"value": ValueError("grid_thw: expected 3 values"),
    b"settings": SettingsError("port: expected an integer"),
    b"blocks": NoFreeBlocksError(8, 2),
    b"timeout": TimeoutError("pull timed out"),
    b"bug": KeyError("oops"),
    b"named": RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, "kv.blocks[2].length: too long"),
}


class Probe:
    """A tiny servicer over raw bytes: unary Call and streaming Stream."""

    def __init__(self, lifecycle: ServerLifecycle) -> None:
        self.lifecycle = lifecycle
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    @rpc_errors
    async def call(self, request: bytes, context: Any) -> bytes:
        async with self.lifecycle.track():
            if request in ERRORS:
                raise ERRORS[request]
            return b"ok:" + request

    @rpc_errors
    async def stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        async with self.lifecycle.track():
            yield b"first"
            self.started.set()
            if request == b"fail":
                raise MultimodalLayoutError("mm_positions", "out of the prompt")
            if request == b"wait":
                await self.release.wait()
            yield b"second"

    def add(self, server: Any) -> None:
        handlers = {
            "Call": grpc.unary_unary_rpc_method_handler(self.call),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture
async def probe() -> AsyncIterator[tuple[Probe, RunningServer, Any]]:
    lifecycle = ServerLifecycle()
    impl = Probe(lifecycle)
    running = await start_server([impl.add], service_names=[SERVICE])
    lifecycle.attach(running)
    ch = channel(running.address)
    try:
        yield impl, running, ch
    finally:
        await ch.close()
        await running.stop(0)


def _call(ch: Any) -> Any:
    return ch.unary_unary(f"/{SERVICE}/Call")


def _stream(ch: Any) -> Any:
    return ch.unary_stream(f"/{SERVICE}/Stream")


async def _health(ch: Any, service: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=2
    )
    return int(reply.status)


@pytest.mark.parametrize(
    ("request_bytes", "code", "needle"),
    [
        (b"layout", grpc.StatusCode.INVALID_ARGUMENT, "run_lengths"),
        (b"value", grpc.StatusCode.INVALID_ARGUMENT, "grid_thw"),
        (b"settings", grpc.StatusCode.INVALID_ARGUMENT, "port"),
        (b"blocks", grpc.StatusCode.RESOURCE_EXHAUSTED, "KV blocks"),
        (b"timeout", grpc.StatusCode.DEADLINE_EXCEEDED, "pull timed out"),
        (b"bug", grpc.StatusCode.INTERNAL, "KeyError"),
        (b"named", grpc.StatusCode.INVALID_ARGUMENT, "too long"),
    ],
)
async def test_error_mapping(probe: Any, request_bytes: bytes, code: Any, needle: str) -> None:
    _, _, ch = probe
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _call(ch)(request_bytes, timeout=5)
    assert info.value.code() == code
    assert needle in info.value.details()
    if request_bytes == b"layout":
        assert ("epd-field", "run_lengths") in tuple(info.value.trailing_metadata())
    if request_bytes == b"named":  # an RpcStatusError whose details lead with the field
        assert ("epd-field", "kv.blocks[2].length") in tuple(info.value.trailing_metadata())
    # The server survived and still answers.
    assert await _call(ch)(b"x", timeout=5) == b"ok:x"


async def test_stream_error_after_messages(probe: Any) -> None:
    _, _, ch = probe
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for message in _stream(ch)(b"fail", timeout=5):
            got.append(message)
    assert got == [b"first"]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mm_positions" in info.value.details()


async def test_health_serving_for_each_name(probe: Any) -> None:
    _, running, ch = probe
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await _health(ch) == serving
    assert await _health(ch, SERVICE) == serving
    await running.set_serving(False)
    assert await _health(ch, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    await running.set_serving(True)
    await wait_healthy(running.address, timeout_s=2, service=SERVICE)


async def test_drain_finishes_in_flight_and_refuses_new(probe: Any) -> None:
    impl, _, ch = probe
    lifecycle: ServerLifecycle = impl.lifecycle
    assert lifecycle.state == LifecycleState.SERVING
    call = _stream(ch)(b"wait", timeout=10)
    assert await call.read() == b"first"
    await impl.started.wait()

    drain = asyncio.create_task(lifecycle.drain(timeout_s=10))
    while lifecycle.state != LifecycleState.DRAINING:
        await asyncio.sleep(0.01)
    assert await _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await _health(ch, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _call(ch)(b"late", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "draining"
    assert not drain.done()

    impl.release.set()
    assert await call.read() == b"second"
    assert await call.code() == grpc.StatusCode.OK
    assert await asyncio.wait_for(drain, 5) is True
    assert lifecycle.state == LifecycleState.STOPPED
    assert lifecycle.active == 0


async def test_drain_timeout_cancels(probe: Any) -> None:
    impl, _, ch = probe
    call = _stream(ch)(b"wait", timeout=10)
    assert await call.read() == b"first"
    assert await impl.lifecycle.drain(timeout_s=0.2) is False
    assert impl.lifecycle.state == LifecycleState.STOPPED
    assert await call.code() != grpc.StatusCode.OK


async def test_wait_healthy_times_out() -> None:
    running = await start_server([])
    address = running.address
    await running.stop(0)
    with pytest.raises(TimeoutError):
        await wait_healthy(address, timeout_s=0.3)


def test_service_name() -> None:
    assert service_name(registry_service_pb2, "RegistryService") == "epd.v1.RegistryService"


# ------------------------------------------------------------------------------ registrar


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
        capabilities=["nixl"],
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
        assert fake.registered[0].capabilities == ["nixl"]
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
        router = await _start_registry(fake, port=port)
        assert await registrar.wait_registered(5) == "w1"
    finally:
        await registrar.stop()
        if router is not None:
            await router.stop(0)


async def test_a_worker_registers_again_within_a_second_of_its_router_coming_back() -> None:
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
        assert time.monotonic() - back < 1.5
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
            await _until(lambda why=why: any(why in r.getMessage() for r in caplog.records))
            await registrar.stop()
            worker_side = [r for r in caplog.records if r.name == "common.server.registrar"]
            assert any(why in r.getMessage() for r in worker_side), why
            assert any(why in reason for reason in registry.refusals.values()), why
    finally:
        await router.stop(0)


def test_a_failed_calls_log_line_names_its_request() -> None:
    # Worker lines named the handler alone: nothing tied them to the router's line for the
    # request. The id is the caller's: escaped, so it cannot forge a line.
    from types import SimpleNamespace

    from common.server.rpc import _where

    request = SimpleNamespace(request_id="r-1\nINFO forged")
    assert _where("DecodeServicer.Decode", (None, request, None)) == (
        "DecodeServicer.Decode (request r-1\\nINFO forged)"
    )
    assert _where("Probe.call", (None, b"raw", None)) == "Probe.call"


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
