"""The HTTP API's checks of a request's head (`router.http.body`), against a router with no
workers over raw sockets (a review against OpenAI's API, s29): a header sent twice, a
compressed body, a body refused before it is read (or read whole before the answer), a
caller without credentials, a trailing slash, HEAD, a client gone mid-body. The body's own
parsing is in tests/test_http_strict.py.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.cluster import CLIENT_KEY
from tests.test_http_api import MODEL_ID, fake_router, url_of
from tests.test_http_strict import HI, chat
from tests.test_router import Cluster as FakeCluster

# The tests share one router (`router`): they run on the module's event loop.
ON_ROUTER = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(ckpt: Path) -> AsyncIterator[FakeCluster]:
    """One router for the module's tests of the request head (on the module's loop)."""
    c = await fake_router(ckpt, max_message_mb=1)  # no workers: refusals come first
    yield c
    await c.close()


async def exchange(c: FakeCluster, head: str, body: bytes = b"") -> tuple[int, dict[str, str], Any]:
    """Send a request head (its lines, without the blank line) and `body` on a new
    connection: the answer's status, headers (lower-case names) and JSON body (None: none).
    A `connection` header of "close" is checked: the router closes the connection."""
    host, port = url_of(c).removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{head}\r\nHost: x\r\n\r\n".encode() + body)
        lines = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if x)}
        length = int(headers.get("content-length", "0"))
        data = await asyncio.wait_for(reader.readexactly(length), 10)
        if headers.get("connection") == "close":
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
        return status, headers, json.loads(data) if data else None
    finally:
        writer.close()


POST = "POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json"
KEY = f"Authorization: Bearer {CLIENT_KEY}"
BODY = json.dumps(chat(max_tokens=2)).encode()


@pytest.mark.parametrize(
    "head",
    [
        f"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer bad\r\n{KEY}",
        f"GET /v1/models HTTP/1.1\r\n{KEY}\r\nAuthorization: Bearer bad",
        f"{POST}\r\nAuthorization: Bearer bad\r\n{KEY}\r\nContent-Length: {len(BODY)}",
        f"{POST}\r\n{KEY}\r\n{KEY}\r\nContent-Length: {len(BODY)}",
        f"{POST}\r\n{KEY}\r\nContent-Type: text/plain\r\nContent-Length: {len(BODY)}",
    ],
)
@ON_ROUTER
async def test_a_header_sent_twice_is_refused_on_every_method(
    router: FakeCluster, head: str
) -> None:
    # GET read the first Authorization, POST the last: a proxy that adds its own key was
    # honoured on one and not the other.
    status, headers, reply = await exchange(router, head, b"" if "GET" in head else BODY)
    assert status == 400, reply
    assert "more than one" in reply["error"]["message"], reply
    assert "connection" not in headers  # a POST's body, sent whole, was read and dropped


@ON_ROUTER
async def test_a_compressed_body_is_415_before_it_is_read(router: FakeCluster) -> None:
    head = f"{POST}\r\n{KEY}\r\nContent-Encoding: gzip\r\nContent-Length: {len(BODY)}"
    status, headers, reply = await exchange(router, head, BODY)
    assert status == 415, reply
    assert reply["error"]["message"] == (
        "Content-Encoding gzip is not supported: send the body uncompressed"
    )
    assert "connection" not in headers  # its body, sent whole, was read and dropped
    # identity is no coding; without workers the (parsed) request gets 503.
    head = f"{POST}\r\n{KEY}\r\nContent-Encoding: identity\r\nContent-Length: {len(BODY)}"
    assert (await exchange(router, head, BODY))[0] == 503


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (f"{POST}\r\n{KEY}\r\nContent-Length: {1 << 40}", 413),
        (f"{POST}\r\nAuthorization: Bearer bad\r\nContent-Length: {1 << 20}", 401),
        (f"{POST}\r\nContent-Length: {1 << 20}", 401),
        (f"{POST}\r\nAuthorization: Bearer bad\r\nTransfer-Encoding: chunked", 401),
    ],
)
@ON_ROUTER
async def test_a_refusal_before_a_body_that_does_not_come_closes_the_connection(
    router: FakeCluster, head: str, status: int
) -> None:
    # The connection was kept and the body drained, up to the Content-Length announced:
    # one past `DRAIN_BYTES` is not waited for, one not sent for `DRAIN_IDLE_S` no longer.
    got, headers, reply = await exchange(router, head)
    assert got == status, reply
    assert headers.get("connection") == "close", headers


@pytest.mark.parametrize(
    ("key", "size", "status"),
    [
        (f"Bearer {CLIENT_KEY}", 3 << 20, 413),  # past max_message_mb, within DRAIN_BYTES
        ("Bearer bad", 200 << 10, 401),  # within DRAIN_ANONYMOUS_BYTES
    ],
)
@ON_ROUTER
async def test_a_refused_body_sent_whole_is_read_before_the_answer(
    router: FakeCluster, key: str, size: int, status: int
) -> None:
    # Closed at once, a client that sends its whole body before it reads (http.client,
    # httpx) got BrokenPipeError instead of its 401 or 413.
    body = b" " * size
    head = f"{POST}\r\nAuthorization: {key}\r\nContent-Length: {len(body)}"
    got, headers, reply = await exchange(router, head, body)
    assert got == status, reply
    assert "connection" not in headers  # it may serve the next request


@ON_ROUTER
async def test_a_caller_without_credentials_gets_no_large_body_read(router: FakeCluster) -> None:
    # Every refused body was read up to 16 MiB: twenty keyless 16 MiB posts cost the router
    # 28 ms of CPU each. gRPC reads nothing of such a caller's request.
    head = f"{POST}\r\nAuthorization: Bearer bad\r\nContent-Length: {1 << 20}"
    got, headers, reply = await exchange(router, head)
    assert got == 401, reply
    assert headers.get("connection") == "close"


@ON_ROUTER
async def test_a_body_refused_before_it_runs_is_counted_as_a_request(router: FakeCluster) -> None:
    # Counting lived in `generate` alone: a body the API refused moved no metric.
    finished = router.router.servicer.orchestrator.metrics.finished.labels("invalid")
    before = finished._value.get()
    body = json.dumps(chat(max_tokens=True)).encode()
    head = f"{POST}\r\n{KEY}\r\nContent-Length: {len(body)}"
    got, _, reply = await exchange(router, head, body)
    assert got == 400 and reply["error"]["param"] == "max_tokens", reply
    assert finished._value.get() == before + 1


@ON_ROUTER
async def test_a_key_named_twice_is_shown_escaped_and_cut(router: FakeCluster) -> None:
    # A lone surrogate in it could not be encoded in the answer: a 500 and a traceback.
    for key, shown in (("\\ud800", "\\ud800"), ("k" * 100_000, "k" * 200)):
        body = f'{{"model": "tiny", "{key}": 1, "{key}": 2}}'.encode()
        head = f"{POST}\r\n{KEY}\r\nContent-Length: {len(body)}"
        got, _, reply = await exchange(router, head, body)
        assert got == 400, reply
        assert reply["error"]["param"] == shown and len(reply["error"]["message"]) < 300


@ON_ROUTER
async def test_a_refusal_of_a_request_without_a_body_keeps_the_connection(
    router: FakeCluster,
) -> None:
    status, headers, _ = await exchange(router, "GET /v1/models HTTP/1.1")
    assert status == 401 and "connection" not in headers


@pytest.mark.parametrize(
    ("head", "body"),
    [
        (f"{POST.replace('completions', 'completions/')}\r\n{KEY}", BODY),
        (f"GET /health/ HTTP/1.1\r\n{KEY}", b""),
        (f"GET /v1/models/ HTTP/1.1\r\n{KEY}", b""),  # it said "the model '' does not exist"
    ],
)
@ON_ROUTER
async def test_a_trailing_slash_is_an_openai_404_not_a_redirect(
    router: FakeCluster, head: str, body: bytes
) -> None:
    # A bare 307 to a Location built from the Host header, which clients follow.
    head += f"\r\nContent-Length: {len(body)}" if body else ""
    status, headers, reply = await exchange(router, head, body)
    assert status == 404 and "location" not in headers, headers
    assert reply["error"]["type"] == "not_found_error", reply
    assert reply["error"]["message"].startswith("no such endpoint: "), reply


@ON_ROUTER
async def test_head_health_is_answered_as_get(router: FakeCluster) -> None:
    host, port = url_of(router).removeprefix("http://").rsplit(":", 1)

    def ask(method: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request(method, "/health")
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    got, body = await asyncio.to_thread(ask, "GET")
    assert got == 503 and body  # no workers
    assert await asyncio.to_thread(ask, "HEAD") == (got, b"")


@ON_ROUTER
async def test_a_key_named_twice_is_refused_over_http(router: FakeCluster) -> None:
    data = f'{{"model": "nope", "model": "{MODEL_ID}", "messages": {HI}}}'.encode()
    status, _, reply = await exchange(
        router, f"{POST}\r\n{KEY}\r\nContent-Length: {len(data)}", data
    )
    assert (status, reply["error"]["param"]) == (400, "model"), reply
    assert reply["error"]["message"] == "the body names 'model' twice"


@ON_ROUTER
async def test_a_client_gone_while_sending_its_body_is_counted_not_a_traceback(
    router: FakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # A keyed client hanging up mid-body raised ClientDisconnect into uvicorn: an ERROR
    # "Exception in ASGI application" with a traceback, and no count.
    caplog.set_level(logging.INFO)
    metrics = router.router.servicer.orchestrator.metrics.finished
    cancelled, invalid = metrics.labels("cancelled"), metrics.labels("invalid")
    before = cancelled._value.get(), invalid._value.get()
    host, port = url_of(router).removeprefix("http://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"{POST}\r\n{KEY}\r\nContent-Length: 1000\r\nHost: x\r\n\r\n".encode() + b"{")
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    for _ in range(50):
        if cancelled._value.get() > before[0]:
            break
        await asyncio.sleep(0.05)
    assert cancelled._value.get() == before[0] + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # A body refused on a path that runs no request is not a request (it was "invalid").
    body = b" " * (2 << 20)
    head = f"POST /health HTTP/1.1\r\n{KEY}\r\nContent-Length: {len(body)}"
    assert (await exchange(router, head, body))[0] == 413
    assert invalid._value.get() == before[1]
