"""`[router] http_header_timeout_s` and `http_max_connections` (`router.http.connections`):
a connection that sends no whole request head in time is closed, as is one past the cap,
while requests on the others are answered as ever. A body that does not arrive within
`request_timeout_s` of its head is answered 408 and gives back what it held
(`router.http.body`). Every connection sends without Nagle's delay."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from router.http.connections import (
    INVALID_EVERY_S,
    INVALID_REQUESTS,
    ConnectionStats,
    bounded_protocol,
)
from router.http.server import HttpServer
from tests.cluster import ADMIN_KEY, CLIENT_KEY
from tests.test_http_api import MODEL_ID, add_workers, call, fake_router, url_of
from tests.test_router import Cluster as FakeCluster


@pytest.fixture
async def strict(ckpt: Path) -> AsyncIterator[FakeCluster]:
    c = await fake_router(ckpt, http_header_timeout_s=0.5, http_max_connections=3)
    await add_workers(c)
    yield c
    await c.close()


def host_port(c: FakeCluster) -> tuple[str, int]:
    host, port = url_of(c).removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the router sent on `sock` before closing it within `seconds` (None: still
    open)."""
    sock.setblocking(False)
    deadline = time.monotonic() + seconds
    sent = b""
    while time.monotonic() < deadline:
        try:
            more = sock.recv(1 << 16)
            if more == b"":
                return sent
            sent += more
        except BlockingIOError:
            pass
        except ConnectionResetError:
            return sent
        await asyncio.sleep(0.02)
    return None


async def test_a_connection_without_a_request_head_in_time_is_closed(
    strict: FakeCluster,
) -> None:
    address = host_port(strict)
    silent = socket.create_connection(address)
    dribbling = socket.create_connection(address)
    try:
        for line in (b"GET /health HTTP/1.1\r\n", b"X-Slow: 1\r\n"):  # never a whole head
            dribbling.sendall(line)
            await asyncio.sleep(0.2)
        assert await closed_within(silent, 1.0) == b""
        assert await closed_within(dribbling, 1.0) is not None
        page = await asyncio.to_thread(metrics_page, url_of(strict))
        assert 'epd:http_connections_closed_total{reason="header_timeout"} 2.0' in page
    finally:
        silent.close()
        dribbling.close()
    # A client that sends its request at once is answered, twice on one connection (its
    # wait for the second head starts after the first answer).
    reader, writer = await asyncio.open_connection(*address)
    try:
        for _ in range(2):
            await asyncio.sleep(0.3)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
    finally:
        writer.close()


async def test_a_connection_past_the_cap_is_closed_as_it_opens(strict: FakeCluster) -> None:
    address = host_port(strict)
    held = [socket.create_connection(address) for _ in range(3)]
    try:
        await asyncio.sleep(0.1)
        with socket.create_connection(address) as extra:
            told = await closed_within(extra, 0.3)  # well before the head timeout
            assert told is not None and told.startswith(b"HTTP/1.1 503"), told
            error = json.loads(told.split(b"\r\n\r\n", 1)[1])["error"]  # it was empty
            assert error["type"] == "service_unavailable", error
    finally:
        for sock in held:
            sock.close()
    for _ in range(50):  # the router sees them gone, then serves again
        if (await asyncio.to_thread(call, f"{url_of(strict)}/health"))[0] == 200:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("/health never answered once the connections were gone")
    page = await asyncio.to_thread(metrics_page, url_of(strict))
    assert 'epd:http_connections_closed_total{reason="cap"} 1.0' in page
    assert "epd:http_connections 1.0" in page  # the scrape's own


async def test_a_connection_whose_answers_go_unread_is_closed(strict: FakeCluster) -> None:
    # Requests pipelined without reading an answer: once the buffers filled, uvicorn waited
    # to write for ever and the head timer never ran again (held 68 s and on, from a caller
    # without a key; httpattack review, s33).
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(host_port(strict))
    request = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_KEY}\r\n\r\n"
    sock.settimeout(0.5)
    try:
        with contextlib.suppress(TimeoutError):  # the router stopped reading: it waits to write
            for _ in range(2000):
                sock.sendall(request.encode() * 8)
                await asyncio.sleep(0)
        for _ in range(100):  # http_header_timeout_s 0.5 of unread answers, then closed
            page = await asyncio.to_thread(metrics_page, url_of(strict))
            if 'epd:http_connections_closed_total{reason="unread"} 1.0' in page:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the connection was not closed")
    finally:
        sock.close()


def metrics_page(url: str) -> str:
    """The router's metrics at `url`/metrics, for the admin key, answered there (no
    redirect: curl does not follow one)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        reply = conn.getresponse()
        assert reply.status == 200, (reply.status, reply.getheaders())
        page = reply.read().decode()
    finally:
        conn.close()
    return page


async def test_a_body_that_does_not_arrive_in_time_is_answered_408(ckpt: Path) -> None:
    c = await fake_router(ckpt, request_timeout_s=1.5)
    try:
        await add_workers(c)
        held = c.router.servicer.held
        body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {CLIENT_KEY}\r\n"
        )
        trickling, silent = (socket.create_connection(host_port(c)) for _ in range(2))
        try:
            # One announces far more than it sends; the other sends its chunked head only.
            trickling.sendall(f"{head}Content-Length: 100000\r\n\r\n".encode() + body[:5])
            silent.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            for _ in range(100):  # the router runs on this event loop
                if held.held == 100_000:  # held as announced, from the head on
                    break
                await asyncio.sleep(0.01)
            assert held.held == 100_000
            for sock in (trickling, silent):
                told = await closed_within(sock, 5.0)  # answered, then closed
                assert told is not None and told.startswith(b"HTTP/1.1 408"), told
                assert b"request_timeout_s" in told
            assert held.held == 0
            page = await asyncio.to_thread(metrics_page, url_of(c))
            assert 'epd:http_connections_closed_total{reason="body_timeout"} 2.0' in page
        finally:
            trickling.close()
            silent.close()
        # A body sent at once is served as ever.
        status, _, reply = await asyncio.to_thread(
            call, f"{url_of(c)}/v1/completions", json.loads(body), CLIENT_KEY
        )
        assert status == 200, reply
    finally:
        await c.close()


async def test_every_connection_sends_without_nagle_delay() -> None:
    """The listening socket is bound before uvicorn starts, without `IPPROTO_TCP` named, so
    asyncio leaves Nagle on; the protocol turns it off, or a kept-alive client got a
    stream's first events about 40 ms late, in one burst (`router.http.connections`)."""
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    stats = ConnectionStats()
    server = HttpServer(app, "127.0.0.1", 0, 1 << 20, 5.0, None, bounded_protocol(5.0, 0, stats))
    await server.start()
    try:
        host, port = server.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
                b"HTTP/1.1 200"
            )
            connections = server._server.server_state.connections
            assert len(connections) == 1
            for protocol in connections:
                sock = protocol.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            writer.close()
    finally:
        await server.stop()


async def test_a_body_framed_both_by_length_and_chunked_is_refused(ckpt: Path) -> None:
    # h11 reads such a body chunked, but its Content-Length was what the size limit and the
    # budget counted: a 3 MiB body past a 1 MiB limit was served, held as 1 byte (and a proxy
    # that frames by the length would read the rest as another request).
    c = await fake_router(ckpt, max_message_mb=1)
    try:
        await add_workers(c)
        pad = "x" * (3 << 20)  # an unknown field: ignored, once read
        body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "pad": pad})
        chunked = b"%x\r\n" % len(body) + body.encode() + b"\r\n0\r\n\r\n"
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {CLIENT_KEY}\r\nTransfer-Encoding: chunked\r\n"
        )
        for extra, status in (("Content-Length: 1\r\n", b"400"), ("", b"413")):
            reader, writer = await asyncio.open_connection(*host_port(c))
            try:
                writer.write(f"{head}{extra}\r\n".encode() + chunked)
                told = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10.0)
                assert told.startswith(b"HTTP/1.1 " + status), told
            finally:
                writer.close()
        assert c.router.servicer.held.held == 0
    finally:
        await c.close()


async def test_garbage_connections_are_logged_once_in_a_while(
    strict: FakeCluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # uvicorn logged a WARNING for each connection whose bytes are not HTTP: callers who
    # need no key grew the router's log by a line each (leaks review, s32).
    now = [1000.0]
    monkeypatch.setattr(INVALID_REQUESTS, "clock", lambda: now[0])
    monkeypatch.setattr(INVALID_REQUESTS, "last", -INVALID_EVERY_S)
    monkeypatch.setattr(INVALID_REQUESTS, "dropped", 0)  # earlier tests' (test_http_chunks)
    caplog.set_level(logging.WARNING, logger="uvicorn.error")

    async def garbage() -> None:
        sock = socket.create_connection(host_port(strict))
        try:
            sock.sendall(b"\x16\x03\x01 not HTTP at all\r\n\r\n")
            assert await closed_within(sock, 5) is not None
        finally:
            sock.close()

    def invalid() -> list[str]:
        return [r.getMessage() for r in caplog.records if "Invalid HTTP request" in r.getMessage()]

    for _ in range(5):
        await garbage()
    assert invalid() == ["Invalid HTTP request received."]
    now[0] += INVALID_EVERY_S
    await garbage()
    assert invalid()[1:] == ["Invalid HTTP request received. (4 more since)"]
    # A request to upgrade the connection (h2c, WebSocket) wrote two lines of its own.
    for _ in range(5):
        sock = socket.create_connection(host_port(strict))
        try:
            sock.sendall(
                b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
            )
            await closed_within(sock, 2)
        finally:
            sock.close()
    upgrades = [r for r in caplog.records if "upgrade" in r.getMessage().lower()]
    assert len(upgrades) <= 1
