"""A peer that stops answering: its calls end with UNAVAILABLE (tried elsewhere), never at
their deadline, and never with a CancelledError the caller did not ask for.

A frozen process (SIGSTOP: its kernel still holds the connection) is the case TCP does not
see: only an unanswered HTTP/2 ping does (`common.server.transport.keepalive_options`). The
router drops a silent worker and closes its channel; calls still in flight on it must not
end as cancelled (`common.server.peers.uncut`), which gave the client no answer at all.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from common.server.peers import PeerClient, stream_uncut, uncut
from common.server.rpc import channel, start_server

# A process serving `t.T/Slow` (answers after the seconds its request names) on a free port,
# printing the port; or calling a server's `t.T/Slow` and sleeping.
SERVER = textwrap.dedent(
    """
    import asyncio, grpc
    from common.server.rpc import start_server

    async def slow(request, context):
        await asyncio.sleep(float(request.decode()))
        return b"done"

    async def main():
        handler = grpc.method_handlers_generic_handler(
            "t.T", {"Slow": grpc.unary_unary_rpc_method_handler(slow)}
        )
        running = await start_server([lambda s: s.add_generic_rpc_handlers((handler,))])
        print(running.address, flush=True)
        await running.wait_for_termination()

    asyncio.run(main())
    """
)
CLIENT = textwrap.dedent(
    """
    import sys, time, grpc
    ch = grpc.insecure_channel(sys.argv[1])
    future = ch.unary_unary("/t.T/Slow").future(b"60", timeout=60)
    print("sent", flush=True)
    time.sleep(60)
    """
)


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


@pytest.fixture
def frozen_server() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = _spawn(SERVER)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip(), proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def _slow_handler(calls: list[str]) -> grpc.GenericRpcHandler:
    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls.append("started")
        try:
            await asyncio.sleep(float(request.decode()))
        except asyncio.CancelledError:
            calls.append("cancelled")
            raise
        return b"done"

    return grpc.method_handlers_generic_handler(
        "t.T", {"Slow": grpc.unary_unary_rpc_method_handler(slow)}
    )


async def test_a_call_on_a_frozen_server_fails_over_within_two_pings(frozen_server) -> None:
    address, proc = frozen_server
    async with channel(address, keepalive_s=0.3) as ch:
        slow = ch.unary_unary("/t.T/Slow")
        assert await slow(b"0", timeout=10) == b"done"  # connected, answering
        # Not a quiet channel's ping budget: a long call keeps pinging without data.
        assert await slow(b"1.5", timeout=10) == b"done"
        call = slow(b"30", timeout=30)
        await asyncio.sleep(0.2)
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        waited = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert waited < 5, waited  # 2 x 0.3 s of pings, not the call's 30 s deadline


async def test_a_new_connection_to_a_frozen_server_fails_within_two_pings(frozen_server) -> None:
    # Frozen before any connection: its kernel accepts one, but no HTTP/2 handshake comes and
    # no ping can be sent. gRPC's own connect limit held the call 20 s (or to its deadline).
    address, proc = frozen_server
    os.kill(proc.pid, signal.SIGSTOP)
    async with channel(address, keepalive_s=0.3) as ch:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await ch.unary_unary("/t.T/Slow")(b"0", timeout=30)
        waited = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert waited < 5, waited  # a handshake has as long as a ping's answer, twice


async def test_a_frozen_clients_call_is_cancelled_on_the_server() -> None:
    calls: list[str] = []
    running = await start_server(
        [lambda s: s.add_generic_rpc_handlers((_slow_handler(calls),))], keepalive_s=0.3
    )
    client = _spawn(CLIENT, running.address)
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "sent"
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.05)
        os.kill(client.pid, signal.SIGSTOP)
        started = time.monotonic()
        while "cancelled" not in calls and time.monotonic() - started < 10:
            await asyncio.sleep(0.05)
        assert calls == ["started", "cancelled"]  # not left running for its 60 s
        assert time.monotonic() - started < 5
    finally:
        os.kill(client.pid, signal.SIGCONT)
        client.kill()
        client.wait(10)
        await running.stop(0)


async def test_a_channel_closed_under_a_call_ends_it_with_unavailable() -> None:
    calls: list[str] = []
    running = await start_server([lambda s: s.add_generic_rpc_handlers((_slow_handler(calls),))])
    peers = PeerClient()
    try:
        ch = peers.get(running.address)
        unary = ch.unary_unary("/t.T/Slow")(b"30", timeout=30)
        await asyncio.sleep(0.2)
        await ch.close()  # what the router does to a dropped worker's channel, at the end
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await uncut(unary, running.address)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert running.address in (caught.value.details() or "")

        # A caller that is cancelled still is (its CancelledError is its own).
        ch = channel(running.address)
        task = asyncio.ensure_future(uncut(ch.unary_unary("/t.T/Slow")(b"30"), "x"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await ch.close()
    finally:
        await peers.close()
        await running.stop(0)


async def test_a_stream_closed_under_its_reader_ends_with_unavailable() -> None:
    async def ticks(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for _ in range(300):
            yield b"tick"
            await asyncio.sleep(0.1)

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Ticks": grpc.unary_stream_rpc_method_handler(ticks)}
    )
    running = await start_server([lambda s: s.add_generic_rpc_handlers((handler,))])
    ch = channel(running.address)
    try:
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for message in stream_uncut(ch.unary_stream("/t.T/Ticks")(b""), "w"):
                got.append(message)
                if len(got) == 2:
                    asyncio.get_running_loop().call_soon(asyncio.ensure_future, ch.close())
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert got[:2] == [b"tick", b"tick"]
    finally:
        await ch.close()
        await running.stop(0)


async def test_a_dropped_workers_call_ends_with_unavailable_at_once() -> None:
    calls: list[str] = []
    running = await start_server([lambda s: s.add_generic_rpc_handlers((_slow_handler(calls),))])
    peers = PeerClient()
    try:
        call = peers.get(running.address).unary_unary("/t.T/Slow")(b"30", timeout=30)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        peers.keep_only(())  # the router dropped the worker: no worker is at its address
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await uncut(call, running.address)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # tried on another
        assert time.monotonic() - started < 2
        assert running.address not in peers._channels
    finally:
        await peers.close()
        await running.stop(0)


HANGING_ROUTER = textwrap.dedent(
    """
    import asyncio
    from common.server.rpc import start_server
    from epd.v1 import router_service_pb2, router_service_pb2_grpc

    class Router(router_service_pb2_grpc.RouterServiceServicer):
        async def Generate(self, request, context):
            yield router_service_pb2.GenerateResponse(token_ids=[5], text="he")
            await asyncio.sleep(60)

    async def main():
        running = await start_server(
            [lambda s: router_service_pb2_grpc.add_RouterServiceServicer_to_server(Router(), s)]
        )
        print(running.address, flush=True)
        await running.wait_for_termination()

    asyncio.run(main())
    """
)


async def test_a_client_with_keepalive_resumes_a_frozen_routers_stream_on_the_next() -> None:
    from common.sampling import SamplingParams
    from epd.client import Client
    from epd.v1 import decode_service_pb2, router_service_pb2, router_service_pb2_grpc

    class Next(router_service_pb2_grpc.RouterServiceServicer):
        def __init__(self) -> None:
            self.resumed: list[list[int]] = []

        async def Generate(self, request, context):
            self.resumed.append(list(request.resume_tokens))
            yield router_service_pb2.GenerateResponse(
                token_ids=[6],
                text="llo",
                finish_reason=decode_service_pb2.FINISH_REASON_LENGTH,
                resumed_tokens=len(request.resume_tokens),  # as a router that resumes says
            )

    second = Next()
    running = await start_server(
        [lambda s: router_service_pb2_grpc.add_RouterServiceServicer_to_server(second, s)]
    )
    first = _spawn(HANGING_ROUTER)
    try:
        assert first.stdout is not None
        addresses = [first.stdout.readline().strip(), running.address]
        chat = [{"role": "user", "content": "hi"}]
        async with Client(addresses, api_key="k", keepalive_s=0.3) as client:
            stream = client.generate(chat, SamplingParams(max_tokens=2), timeout_s=30)
            tokens = list((await anext(stream)).token_ids)
            os.kill(first.pid, signal.SIGSTOP)  # frozen after its first chunk
            started = time.monotonic()
            async for piece in stream:
                tokens.extend(piece.token_ids)
            assert time.monotonic() - started < 5  # not the 30 s deadline
        assert tokens == [5, 6] and second.resumed == [[5]]
    finally:
        os.kill(first.pid, signal.SIGCONT)
        first.kill()
        first.wait(10)
        await running.stop(0)
