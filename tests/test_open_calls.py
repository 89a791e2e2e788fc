"""The methods anyone may call (health, reflection) within bounds (`common.server.open_calls`):
an anonymous caller could make a server read and keep up to `max_message_mb` per call
(security review, s32: a router at 4.9 GB resident, its loop stalled for seconds)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.server import open_calls
from common.server.auth import Authenticator
from common.server.rpc import LIVENESS_SERVICE, RunningServer, channel, start_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

BIG = "x" * (1 << 20)  # a service name or symbol far past OPEN_MESSAGE_BYTES


@pytest_asyncio.fixture(loop_scope="module")
async def server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RunningServer]:
    monkeypatch.setattr(open_calls, "STREAMS_PER_SOURCE", 3)
    monkeypatch.setattr(open_calls, "STREAM_READS_PER_SOURCE", 2)
    monkeypatch.setattr(open_calls, "FIRST_MESSAGE_S", 0.5)
    monkeypatch.setattr(open_calls, "NEXT_MESSAGE_S", 1.5)
    running = await start_server(
        [], max_message_mb=16, auth=Authenticator("the-cluster-bearer-of-this-test")
    )
    yield running
    await running.stop(0)


async def check(ch: grpc.aio.Channel, service: str) -> health_pb2.HealthCheckResponse:
    return await health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10
    )


async def test_open_methods_answer_anyone_as_before(server: RunningServer) -> None:
    async with channel(server.address) as ch:  # no credentials
        assert (await check(ch, LIVENESS_SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await check(ch, "no-such-service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        asks = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
        ]
        asks.append(
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health")
        )
        replies = [r async for r in stub.ServerReflectionInfo(iter(asks), timeout=10)]
        assert len(replies) == 2
        names = {s.name for s in replies[0].list_services_response.service}
        assert "grpc.health.v1.Health" in names
        assert replies[1].file_descriptor_response.file_descriptor_proto


async def test_a_large_request_is_refused_before_it_is_parsed_or_kept(
    server: RunningServer,
) -> None:
    async with channel(server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await check(ch, BIG)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 65536" in (info.value.details() or "")
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=BIG))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await watch.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        big = reflection_pb2.ServerReflectionRequest(file_containing_symbol=BIG)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in stub.ServerReflectionInfo(iter([big]), timeout=10)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not server.health._server_watchers.get(BIG)  # no Watch kept its name


async def test_streams_past_a_sources_limit_are_refused_and_checks_still_answered(
    server: RunningServer,
) -> None:
    async with channel(server.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watches = []
        for _ in range(3):  # one after the other: each one's request read, then running
            watches.append(stub.Watch(health_pb2.HealthCheckRequest(service="")))
            await watches[-1].read()
        extra = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await extra.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A health check is no stream: a source's open Watch calls do not shut it out.
        assert (await check(ch, "")).status == health_pb2.HealthCheckResponse.SERVING
        watches[0].cancel()
        for _ in range(50):  # the server sees the cancellation shortly
            await asyncio.sleep(0.02)
            again = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                await again.read()
                again.cancel()
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            pytest.fail("a Watch was still refused after one ended")
        for watch in watches[1:]:
            watch.cancel()


async def test_idle_reflection_streams_take_no_turn_of_a_health_check(
    server: RunningServer,
) -> None:
    # Reflection streams waiting for their next message held every read turn, and each
    # health check waited for one (own-fix review): they have turns of their own.
    async with channel(server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        idle = [stub.ServerReflectionInfo() for _ in range(2)]
        for call in idle:
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            await call.read()  # answered; now waiting for a next request, past 0.5 s
        await asyncio.sleep(0.7)
        assert (await check(ch, "")).status == health_pb2.HealthCheckResponse.SERVING
        third = stub.ServerReflectionInfo()  # its source's stream turns are taken
        await third.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await third.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in idle:  # an idle stream still answers its next request
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            assert (await call.read()).list_services_response.service
            await call.done_writing()


async def test_a_caller_that_sends_no_request_is_ended(server: RunningServer) -> None:
    async with channel(server.address) as ch:
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):
                await call.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no request within 0.5 s" in (info.value.details() or "")


async def test_a_stream_that_sends_no_next_request_in_time_is_ended(server: RunningServer) -> None:
    # A stream trickling a large next message held its source's turn, and what it had sent,
    # for as long as it liked (own-fix review 2): a user's think-time, no longer.
    async with channel(server.address) as ch:
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):
                await call.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no request within 1.5 s" in (info.value.details() or "")
