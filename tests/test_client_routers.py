"""`epd.client.Client` over several routers, against fake routers in this event loop (real
gRPC on local ports): a stream that breaks mid-answer goes on at the next router, resumed
after the tokens received; one that breaks after its last chunk (the router died before
its final status) is the whole answer, not sent again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from common.sampling import SamplingParams
from epd.answers import GenerateError
from epd.client import Client
from epd.v1 import decode_service_pb2, router_service_pb2, router_service_pb2_grpc

CHAT = [{"role": "user", "content": "hi"}]


def chunk(token_ids: list[int], text: str, last: bool = False) -> Any:
    """A Generate response; the `last` one has finish reason LENGTH."""
    finish = decode_service_pb2.FINISH_REASON_LENGTH if last else None
    return router_service_pb2.GenerateResponse(token_ids=token_ids, text=text, finish_reason=finish)


class FakeRouter(router_service_pb2_grpc.RouterServiceServicer):
    """Streams `chunks` whatever the resumed tokens, then ends with `then` (None: OK);
    records each request's resume tokens."""

    def __init__(
        self, chunks: list[Any], then: grpc.StatusCode | None = None, resumes: bool = True
    ) -> None:
        self.chunks = chunks
        self.then = then
        self.resumes = resumes  # False: a router older than `resume_tokens` (ignores them)
        self.resumed: list[list[int]] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.resumed.append(list(request.resume_tokens))
        for i, response in enumerate(self.chunks):
            if i == 0 and request.resume_tokens and self.resumes:
                response.resumed_tokens = len(request.resume_tokens)
            yield response
        if self.then is not None:
            await context.abort(self.then, "Socket closed")


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []

    async def start(router: FakeRouter) -> str:
        server = grpc.aio.server()
        router_service_pb2_grpc.add_RouterServiceServicer_to_server(router, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


async def test_a_stream_broken_mid_answer_is_resumed_on_the_next_router(serve: Any) -> None:
    first = FakeRouter([chunk([5], "he")], then=grpc.StatusCode.UNAVAILABLE)
    second = FakeRouter([chunk([6], "llo", last=True)])
    addresses = [await serve(first), await serve(second)]
    async with Client(addresses, api_key="k") as client:
        result = await client.generate_text(CHAT, SamplingParams(max_tokens=2))
        assert (result.text, result.token_ids, result.finish_reason) == ("hello", [5, 6], "length")
        assert client.resumes == 1
    assert first.resumed == [[]] and second.resumed == [[5]]


async def test_a_router_that_does_not_resume_is_not_joined_to_the_stream(serve: Any) -> None:
    # A router from before `resume_tokens` streams the answer from its start: joined on, the
    # caller read "he" twice ("hehello").
    first = FakeRouter([chunk([5], "he")], then=grpc.StatusCode.UNAVAILABLE)
    old = FakeRouter([chunk([5], "he"), chunk([6], "llo", last=True)], resumes=False)
    addresses = [await serve(first), await serve(old)]
    texts: list[str] = []
    async with Client(addresses, api_key="k") as client:
        with pytest.raises(GenerateError) as err:
            async for piece in client.generate(CHAT, SamplingParams(max_tokens=2)):
                texts.append(piece.text)
    assert texts == ["he"] and err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "did not say it resumed the stream" in err.value.details


async def test_a_stream_broken_after_its_last_chunk_is_the_whole_answer(serve: Any) -> None:
    """The router died after the chunk with the finish reason, before the final status:
    the client has the whole answer, so it ends there; resuming it elsewhere with every
    token would only be refused (nothing left to generate)."""
    first = FakeRouter(
        [chunk([5], "he"), chunk([6], "llo", last=True)], then=grpc.StatusCode.UNAVAILABLE
    )
    second = FakeRouter([chunk([9], "X", last=True)])
    addresses = [await serve(first), await serve(second)]
    async with Client(addresses, api_key="k") as client:
        chunks = [c async for c in client.generate(CHAT, SamplingParams(max_tokens=2))]
        assert [(c.text, c.finish_reason) for c in chunks] == [("he", None), ("llo", "length")]
        assert client.resumes == 0 and client.retries == 0
    assert second.resumed == []


async def test_a_router_that_accepts_and_never_answers_is_skipped(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failover was on UNAVAILABLE only: a router that takes the connection and never speaks
    # (frozen, black-holed) held each request starting on it for its whole timeout, which
    # then failed DEADLINE_EXCEEDED with a live router beside it.
    import asyncio
    import socket
    import time

    from epd import routers

    monkeypatch.setattr(routers, "CONNECT_S", 0.5)  # the silent router's wait (2 s)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nobody answers
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    live = FakeRouter([chunk([6], "ok", last=True)])
    addresses = [
        f"127.0.0.1:{silent.getsockname()[1]}",
        f"127.0.0.1:{closed.getsockname()[1]}",
        await serve(live),
    ]
    try:
        async with Client(addresses, api_key="k") as client:
            started = time.monotonic()
            result = await asyncio.wait_for(
                client.generate_text(CHAT, SamplingParams(max_tokens=1), timeout_s=30), 30
            )
            took = time.monotonic() - started
            assert result.text == "ok" and client.retries == 2
            assert routers.CONNECT_S <= took < 2 * routers.CONNECT_S  # refused: at once
    finally:
        silent.close()
        closed.close()


class BusyOnce(FakeRouter):
    """Refuses its first call as full (`retry-after-ms` 50), then streams `chunks`."""

    def __init__(self, chunks: list[Any]) -> None:
        super().__init__(chunks)
        self.refused = 0

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if not self.refused:
            self.refused += 1
            self.resumed.append(list(request.resume_tokens))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "admission queue full; retry after 0.1 s",
                trailing_metadata=(("retry-after-ms", "50"),),
            )
        async for response in super().Generate(request, context):
            yield response


async def test_a_resume_refused_as_full_waits_and_goes_on(serve: Any) -> None:
    # On failover the surviving router is the busiest: a resume it refused as full failed
    # the stream whatever `max_retries`, though a resume repeats nothing (client review).
    first = FakeRouter([chunk([5], "he")], then=grpc.StatusCode.UNAVAILABLE)
    second = BusyOnce([chunk([6], "llo", last=True)])
    addresses = [await serve(first), await serve(second)]
    async with Client(addresses, api_key="k", max_retries=2) as client:
        result = await client.generate_text(CHAT, SamplingParams(max_tokens=2))
        assert (result.text, result.token_ids) == ("hello", [5, 6])
        assert (client.resumes, client.busy_retries) == (1, 1)
    assert second.resumed == [[5], [5]]
    # With stop strings a stream is not resumed, so neither is it sent again.
    first.chunks, second.refused = [chunk([5], "he")], 0
    async with Client(addresses, api_key="k", max_retries=2) as client:
        with pytest.raises(GenerateError, match="not resumed"):
            await client.generate_text(CHAT, SamplingParams(max_tokens=2), stop="zz")


async def test_closing_the_client_mid_stream_is_a_generate_error(serve: Any) -> None:
    # gRPC cancels the calls of a closed channel: the reading task got a bare
    # CancelledError, not the GenerateError promised, though nobody cancelled it.
    class Slow(FakeRouter):
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
            yield chunk([5], "he")
            await asyncio.sleep(30)

    client = Client([await serve(Slow([]))], api_key="k")
    started = asyncio.Event()

    async def read() -> None:
        async for _ in client.generate(CHAT, SamplingParams(max_tokens=2)):
            started.set()

    task = asyncio.create_task(read())
    async with asyncio.timeout(10):
        await started.wait()
    await client.close()
    with pytest.raises(GenerateError, match="client was closed") as info:
        await task
    assert info.value.code == grpc.StatusCode.CANCELLED and not task.cancelled()


async def test_an_empty_tls_ca_file_is_plaintext(serve: Any) -> None:
    # An empty $EPD_TLS_CA_FILE turned TLS on (with the system's CAs) against a plaintext
    # router: every call failed (client review).
    address = await serve(FakeRouter([chunk([5], "hi", last=True)]))
    async with Client(address, api_key="k", tls_ca_file="") as client:
        assert (await client.generate_text(CHAT, SamplingParams(max_tokens=1))).text == "hi"


async def test_closing_the_client_while_a_stream_waits_to_send_again_ends_it(serve: Any) -> None:
    # A stream waiting out a refusal's back-off reopened the channels close() had closed,
    # sent again and finished (own-fix review 3).
    busy = BusyOnce([chunk([5], "hi", last=True)])
    client = Client([await serve(busy)], api_key="k", max_retries=3)

    async def read() -> None:
        await client.generate_text(CHAT, SamplingParams(max_tokens=1))

    task = asyncio.create_task(read())
    async with asyncio.timeout(10):
        while not busy.refused:
            await asyncio.sleep(0.005)
    await client.close()
    with pytest.raises(GenerateError, match="client was closed"):
        await task
    assert busy.resumed == [[]]  # not sent again


async def test_closing_the_client_while_a_stream_connects_ends_it(serve: Any) -> None:
    # close() while the stream waited for its first router to connect: gRPC's bare
    # UsageError "Channel is closed", not GenerateError (own-fix review 4).
    good = FakeRouter([chunk([5], "hi", last=True)])
    held: list[Any] = []

    async def hold(reader: Any, writer: Any) -> None:  # accepts, never speaks HTTP/2
        held.append(writer)
        await asyncio.sleep(30)

    hole = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = hole.sockets[0].getsockname()[1]
    client = Client([f"127.0.0.1:{port}", await serve(good)], api_key="k")
    task = asyncio.create_task(client.generate_text(CHAT, SamplingParams(max_tokens=1)))
    async with asyncio.timeout(10):
        while not held:
            await asyncio.sleep(0.01)
    await client.close()
    with pytest.raises(GenerateError, match="client was closed"):
        await task
    assert good.resumed == []
    hole.close()


async def test_a_router_that_did_not_connect_is_tried_last_for_a_while(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A black-holed router in the list cost every other request (the ones starting on it)
    # its whole connect wait, for as long as the Client lived (client review).
    import epd.routers

    monkeypatch.setattr(epd.routers, "CONNECT_S", 0.3)
    good = FakeRouter([chunk([5], "hi", last=True)])
    hole = await asyncio.start_server(lambda r, w: asyncio.sleep(30), "127.0.0.1", 0)
    port = hole.sockets[0].getsockname()[1]
    async with Client([f"127.0.0.1:{port}", await serve(good)], api_key="k") as client:
        for _ in range(4):  # requests 1 and 3 start on the black hole in turn
            result = await client.generate_text(CHAT, SamplingParams(max_tokens=1))
            assert result.text == "hi"
        assert client.retries == 1  # only the first waited for it
    hole.close()


class Draining(router_service_pb2_grpc.RouterServiceServicer):
    """A router that drains: every request refused UNAVAILABLE "draining"."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        yield  # a stream


async def test_a_request_a_draining_router_refused_goes_on_a_new_connection(serve: Any) -> None:
    # Behind a load balancer (one address), the connection kept to a draining router took
    # each request to it, refused "draining" while its longest answer ran, though other
    # routers were ready (deploy review). A new connection goes to another.
    draining, ready = Draining(), FakeRouter([chunk([7], "ok", last=True)])
    targets = [await serve(draining), await serve(ready)]
    connections: list[str] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = targets[min(len(connections), 1)]  # the first to the draining router
        connections.append(target)
        host, port = target.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    balancer = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        address = f"127.0.0.1:{balancer.sockets[0].getsockname()[1]}"
        async with Client(address, api_key="k") as client:
            result = await client.generate_text(CHAT, SamplingParams(max_tokens=2))
        assert (result.text, draining.calls, connections) == ("ok", 1, targets)
    finally:
        balancer.close()


async def test_with_several_routers_a_draining_one_is_not_asked_again(serve: Any) -> None:
    # A new connection to a router named directly reaches it again: every request starting
    # there was refused twice (ownfix review); the next router answers it.
    draining, ready = Draining(), FakeRouter([chunk([7], "ok", last=True)])
    async with Client([await serve(draining), await serve(ready)], api_key="k") as client:
        for _ in range(6):
            assert (await client.generate_text(CHAT, SamplingParams(max_tokens=2))).text == "ok"
    assert draining.calls == 3  # the requests that started on it, once each


async def test_closing_the_client_while_a_draining_router_refuses_ends_the_stream(
    serve: Any,
) -> None:
    # A close meanwhile gave the caller an AssertionError from the reopen (ownfix review).
    draining = Draining()
    address = await serve(draining)
    for delay in (0.0, 0.001, 0.005, 0.02):
        client = Client(address, api_key="k")
        call = asyncio.ensure_future(client.generate_text(CHAT, SamplingParams(max_tokens=2)))
        await asyncio.sleep(delay)
        await client.close()
        with pytest.raises(GenerateError) as err:
            await call
        assert err.value.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
