"""A draining router's HTTP connections: every answer that starts during the drain says
`Connection: close`, and one under way when it began (a stream, its head already sent) closes
its connection once it ends, so a keep-alive client's next request goes to a new connection
(another router) instead of a 503 here."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, cast

from router.http.server import HttpServer


async def test_an_answer_that_starts_after_the_drain_began_says_close() -> None:
    # Decided as the request came: one under way at SIGTERM answered without it, and the
    # keep-alive client's next request on that connection got a 503 (s35diff review, s36).
    from router.http.connections import CloseWhileDraining

    draining = False
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"1")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def late_answer(scope: Any, receive: Any, send: Any) -> None:
        nonlocal draining
        draining = True  # SIGTERM while the answer was being made
        await app(scope, receive, send)

    wrapped = CloseWhileDraining(late_answer, lambda: draining)
    await wrapped({"type": "http"}, None, send)
    assert sent[0]["headers"] == [(b"a", b"1"), (b"connection", b"close")]
    sent.clear()
    draining = False
    await CloseWhileDraining(app, lambda: draining)({"type": "http"}, None, send)
    assert sent[0]["headers"] == [(b"a", b"1")]  # not draining: as the app said


async def test_a_stream_under_way_when_the_drain_begins_closes_its_connection_after() -> None:
    # Its head went out before the drain, without `Connection: close`: kept alive, the
    # client's next request on it got 503 (ownfix review, s36).
    go_on = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"data: 0\n\n", "more_body": True})
        await go_on.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    server = HttpServer(cast(Any, app), "127.0.0.1", 0, 1 << 20, 5.0)
    await server.start()
    host, port = server.address.rsplit(":", 1)

    def stream() -> bytes:
        request = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request)
            got = sock.recv(65536)  # the head and the first event
            asyncio.run_coroutine_threadsafe(drained(), loop).result(10)
            while b"[DONE]" not in got:
                got += sock.recv(65536)
            try:  # the next request on it: kept alive, it is answered
                sock.sendall(request)
                while chunk := sock.recv(65536):
                    got += chunk
            except OSError:  # reset: closed, as it should be
                pass
            return got

    async def drained() -> None:
        await server.close_after_answers()  # what the drain's hook does
        go_on.set()

    loop = asyncio.get_running_loop()
    try:
        answer = await asyncio.to_thread(stream)
    finally:
        await server.stop()
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
    assert b"connection: close" not in answer.lower()  # the head went out before the drain
