"""The router's admin and registry services, against the fake workers of `tests.test_router`.

Pins: Status lists the workers by role, Drain takes a worker out of routing, Scale is
UNIMPLEMENTED without a scaler and delegates to one, and a registration whose KV layout does
not match is FAILED_PRECONDITION.
"""

from __future__ import annotations

import grpc
import pytest

from common.roles import Role
from common.server.rpc import channel
from epd.client import GenerateError
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc, registry_service_pb2
from router.server import serve
from router.settings import RouterSettings
from tests.cluster import admin_credentials, cluster_security
from tests.test_router import MODEL, TEXT, worker_info
from tests.test_router import ckpt as ckpt  # fixture
from tests.test_router import cluster as cluster  # fixture
from tests.test_router import workers as workers  # fixture


async def test_admin_status_drain_and_scale(cluster, workers):
    status = await cluster.admin.Status(admin_service_pb2.StatusRequest())
    assert [w.info.role for w in status.workers] == [
        registry_service_pb2.WORKER_ROLE_ENCODER,
        registry_service_pb2.WORKER_ROLE_PREFILL,
        registry_service_pb2.WORKER_ROLE_DECODE,
    ]
    assert status.model == MODEL
    decode_address = status.workers[2].info.address
    drained = await cluster.admin.Drain(admin_service_pb2.DrainRequest(address=decode_address))
    assert drained.found
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE  # the only decode worker drains
    status = await cluster.admin.Status(
        admin_service_pb2.StatusRequest(role=registry_service_pb2.WORKER_ROLE_DECODE)
    )
    assert [w.draining for w in status.workers] == [True]
    assert [w.suspect for w in status.workers] == [False]
    registry = cluster.router.registry
    registry.suspect(registry.workers(Role.DECODE)[0])
    status = await cluster.admin.Status(
        admin_service_pb2.StatusRequest(role=registry_service_pb2.WORKER_ROLE_DECODE)
    )
    assert [w.suspect for w in status.workers] == [True]  # a call on it failed
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.admin.Scale(
            admin_service_pb2.ScaleRequest(role=registry_service_pb2.WORKER_ROLE_DECODE)
        )
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Ray" in info.value.details()


async def test_scale_delegates_to_the_scaler(ckpt):
    calls = []

    async def scaler(role: Role, replicas: int) -> int:
        calls.append((role, replicas))
        return replicas

    settings = RouterSettings(
        model=str(ckpt),
        port=0,
        http_port=-1,
        expected_model=MODEL,
        security=cluster_security(),
    )
    router = await serve(settings, scaler=scaler)
    try:
        async with channel(router.address, credentials=admin_credentials()) as ch:
            admin = admin_service_pb2_grpc.AdminServiceStub(ch)
            reply = await admin.Scale(
                admin_service_pb2.ScaleRequest(
                    role=registry_service_pb2.WORKER_ROLE_PREFILL, replicas=3
                )
            )
    finally:
        await router.stop(0)
    assert reply.replicas == 3 and calls == [(Role.PREFILL, 3)]
    assert not reply.tells_replaced  # a scaler without `replaced`: `epd scale` guesses


async def test_scale_answers_the_dead_its_scaler_replaced() -> None:
    # `epd scale` took a death its first poll found for one the scale replaced, and waited
    # its whole timeout (ownfixE review E2, s40).
    from router.admin import AdminServicer
    from router.registry import Registry

    class Scaler:
        async def __call__(self, role: Role, replicas: int) -> int:
            return replicas

        async def replaced(self, role: Role) -> list[str]:
            return [f"epd-{role}-0 died for good: it crashed"]

    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0)
    servicer = AdminServicer(registry, Scaler())
    request = admin_service_pb2.ScaleRequest(
        role=registry_service_pb2.WORKER_ROLE_DECODE, replicas=2
    )
    reply = await servicer.Scale(request, None)
    assert reply.tells_replaced and list(reply.replaced) == [
        "epd-decode-0 died for good: it crashed"
    ]


async def test_mismatched_registration_is_failed_precondition(cluster, workers):
    info = worker_info(Role.DECODE, "127.0.0.1:1", block_size=8)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.registry_stub.Register(registry_service_pb2.RegisterRequest(worker=info))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size=8 (expected 16)" in err.value.details()
    # `epd status` shows it: a refused worker is in no table of workers.
    status = await cluster.admin.Status(admin_service_pb2.StatusRequest())
    (refused,) = status.refused_registrations
    assert refused.startswith("127.0.0.1:1: ") and "block_size=8 (expected 16)" in refused
    assert cluster.router.registry.refusals.of("decode") == 1  # counted as a decode worker's


async def test_status_counts_requests_not_their_calls_on_workers() -> None:
    # It summed each worker's calls: one request on two encoders at once showed as two.
    from router.admin import AdminServicer
    from tests.test_admission import deployment, make

    registry = deployment()
    for worker in registry.workers():
        worker.in_flight = 1  # one request's calls: its prefill and its decode
    servicer = AdminServicer(registry, None, make(registry), lambda: 1)
    reply = await servicer.Status(admin_service_pb2.StatusRequest(), None)
    assert reply.active_requests == 1
    assert AdminServicer(registry).registry.active_requests == 2  # what it said before


async def test_status_names_the_workers_dropped_for_their_silence() -> None:
    # A frozen or dead worker left the table without a word: which one, only the router's
    # log said (walkthrough review, s39). One that drained and left is no news.
    from router.admin import DROPPED_FOR_S, AdminServicer
    from router.registry import Registry
    from tests.registry_helpers import info

    now = [100.0]
    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=lambda: now[0])
    servicer = AdminServicer(registry)
    silent = info(Role.DECODE, 7001)
    registry.register(silent)
    leaving = registry.register(info(Role.PREFILL, 7002))
    registry.drain(leaving.address)
    now[0] += 5.0
    registry.expire()
    now[0] += 2.0
    reply = await servicer.Status(admin_service_pb2.StatusRequest(), None)
    assert list(reply.dropped_workers) == [
        f"decode {silent.name} {silent.address}: no heartbeat for 5.0 s, dropped 2 s ago"
    ]
    registry.register(silent)  # back (SIGCONT, a restart under its name)
    reply = await servicer.Status(admin_service_pb2.StatusRequest(), None)
    assert list(reply.dropped_workers) == []
    now[0] += 5.0
    registry.expire()
    now[0] += DROPPED_FOR_S + 1  # long ago: no longer news
    reply = await servicer.Status(admin_service_pb2.StatusRequest(), None)
    assert list(reply.dropped_workers) == []


async def test_a_dropped_workers_silence_counts_the_routers_own_stalls() -> None:
    # The router's stall is excused (no worker is dropped for it) but it passed: `epd status`
    # said "no heartbeat for 5.0 s" where the router's log said 9.0 s (s39diff N2).
    from router.admin import AdminServicer
    from router.registry import Registry
    from tests.registry_helpers import info

    now = [100.0]
    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=lambda: now[0])
    servicer = AdminServicer(registry)
    silent = registry.register(info(Role.DECODE, 7001))
    now[0] += 4.0
    registry.excuse(4.0)  # the router stalled 4 s
    now[0] += 5.0
    assert registry.seconds_since(silent) == 9.0
    registry.expire()
    reply = await servicer.Status(admin_service_pb2.StatusRequest(), None)
    assert list(reply.dropped_workers) == [
        f"decode {silent.name} {silent.address}: no heartbeat for 9.0 s, dropped 0 s ago"
    ]
