"""Request bodies in many small pieces (`router.http.connections`): chunked bodies of tiny
chunks refused past a bound without holding the event loop, reads handed to h11 in slices
(pipelined requests too), and nothing read after a `Connection: close` request."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import socket
from typing import Any

from fastapi import FastAPI, Request

from router.http.connections import ConnectionStats, bounded_protocol
from router.http.server import HttpServer
from tests import test_http_connections
from tests.cluster import CLIENT_KEY
from tests.loop_gaps import loop_gaps
from tests.test_http_api import MODEL_ID
from tests.test_http_connections import closed_within, host_port
from tests.test_router import Cluster as FakeCluster

strict = test_http_connections.strict  # the router with a 0.5 s head timeout, 3 connections


async def test_a_body_in_many_tiny_chunks_is_refused_without_holding_the_loop(
    strict: FakeCluster,
) -> None:
    # h11 and uvicorn take ~18 µs of the event loop a chunk: a 256 KiB read of 1-byte chunks
    # held it 0.9 s, a body of 2M of them 28 s (stalls review). Handed to h11 in slices, and
    # past 65,536 chunks (plus one a 512 bytes) refused as malformed.
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {CLIENT_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    async with loop_gaps() as gaps:
        # Tiny chunks, and tiny chunks after bytes that pay for 2,048 of them.
        for first in (b"", b"100000\r\n" + b"x" * 0x100000 + b"\r\n"):
            sock = socket.create_connection(host_port(strict))
            try:
                sock.sendall(head.encode() + first + b"1\r\n{\r\n" * 70_000)  # in a read or a few
                sent = await closed_within(sock, 5)
            finally:
                sock.close()
            assert sent is not None and sent.startswith(b"HTTP/1.1 400"), sent
            assert b"too many small pieces" in sent
    assert max(gaps) < 0.3, max(gaps)
    # A body in pieces of a usual size is read as ever, and in small ones written as a
    # JSON encoder yields them (`iterencode`: a piece per token).
    body = json.dumps({"model": MODEL_ID, "prompt": "hi " * 2000, "max_tokens": 2}).encode()
    for pieces in (8, 5000):  # 5000 arrive in a read or two: once refused (ownfix review)
        status, _ = await asyncio.to_thread(chunked_post, strict, body, pieces)
        assert status == 200


def chunked_post(c: FakeCluster, body: bytes, pieces: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*host_port(c), timeout=10)
    try:
        size = -(-len(body) // pieces)
        parts = (body[i : i + size] for i in range(0, len(body), size))
        headers = {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", body=parts, headers=headers, encode_chunked=True)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _slicing_server() -> tuple[HttpServer, list[int]]:
    app = FastAPI()
    app.state.auth = None  # `limit_body`: no keys

    @app.post("/slow")
    async def slow(request: Request) -> dict[str, int]:
        body = await request.body()
        await asyncio.sleep(0.5)
        return {"n": len(body)}

    @app.post("/sha")
    async def sha(request: Request) -> dict[str, Any]:
        body = await request.body()
        return {"n": len(body), "h": hashlib.sha256(body).hexdigest()}

    most = [0]

    class Probe(bounded_protocol(5.0, 0, ConnectionStats())):  # type: ignore[misc]
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            most[0] = max(most[0], len(self._pending))

    return HttpServer(app, "127.0.0.1", 0, 64 << 20, 30.0, None, Probe), most


def _answers_of(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(30)
    got = b""
    while got.count(b"HTTP/1.1 ") < n or not got.endswith(b"}"):
        more = sock.recv(1 << 20)
        if not more:
            break
        got += more
    return got


async def test_a_pipelined_body_of_tiny_chunks_is_not_taken_in_one_go() -> None:
    # h11 buffered what the slices brought while the first request's answer was pending
    # (PAUSED), and uvicorn handed it all on at its end: 21k 1-byte chunks, 0.33 s (ownfix
    # review D).
    server, _ = _slicing_server()
    await server.start()
    try:
        host, port = server.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        async with loop_gaps(0.005) as gaps:
            try:
                first = b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
                second = (
                    b"POST /sha HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"1\r\n \r\n" * 40_000
                    + b"0\r\n\r\n"
                )
                sock.sendall(first + second)
                got = await asyncio.to_thread(_answers_of, sock, 2)
            finally:
                sock.close()
        assert got.count(b"HTTP/1.1 200") == 2, got[-200:]
    finally:
        await server.stop()
    assert max(gaps) < 0.3, max(gaps)


async def test_bytes_read_while_slices_wait_are_not_read_on() -> None:
    # uvicorn resumed reading (its answer to a pipelined request complete) while a read's
    # slices waited: the rest of the connection was read at once, 8 KiB handed on a turn
    # and the rest copied each time (30 MB: 29 MB held, 9 s; ownfix review D).
    server, most = _slicing_server()
    await server.start()
    try:
        host, port = server.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        body = b"[\r\n" + b" 1,\r\n" * 2_000_000 + b" 1\r\n]"
        first = b"POST /sha HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        second = b"POST /sha HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        try:
            sending = asyncio.ensure_future(asyncio.to_thread(sock.sendall, first + second + body))
            got = await asyncio.to_thread(_answers_of, sock, 2)
            await sending
        finally:
            sock.close()
        assert hashlib.sha256(body).hexdigest().encode() in got, got[-200:]
    finally:
        await server.stop()
    assert most[0] <= 2 * 256 * 1024, most[0]  # a read, and one more at most


async def test_what_follows_a_connection_close_request_is_not_read() -> None:
    # A read that carried more after a `Connection: close` request was handed on to h11,
    # which refused it: a 400 went out instead of that request's answer (ownfix review E).
    server, _ = _slicing_server()
    await server.start()
    try:
        host, port = server.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        try:
            request = b"POST /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            sock.sendall(request + b"Content-Length: 2\r\n\r\n{}" + b"\r\n" * 20_000)
            got = await asyncio.to_thread(_answers_of, sock, 1)
        finally:
            sock.close()
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
    finally:
        await server.stop()
