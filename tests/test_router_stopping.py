"""A router whose drain runs out of time while answers stream (`router.stopping`): each ends
with an error that says so, an HTTP stream with an error event and the end of its body, a
gRPC one with UNAVAILABLE, before the stop; not gRPC's "Cancelling all calls", nor a body
cut short that a client reads as a network failure (s42 operator review M1)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.roles import Role
from common.sampling import SamplingParams
from epd.client import GenerateError
from epd.v1 import decode_service_pb2
from router.stopping import STOPPING
from tests.cluster import CLIENT_KEY
from tests.test_http_api import MODEL_ID, fake_router
from tests.test_http_api import ckpt as ckpt  # fixture
from tests.test_router import FakeDecode, FakeEncoder, FakePrefill


class Trickle(FakeDecode):
    """A decode worker that sends a token every `every_s`, up to `max_tokens`."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s

    async def Decode(self, request: Any, context: Any) -> Any:
        for k in range(request.sampling.max_tokens - 1):
            yield decode_service_pb2.DecodeResponse(token_ids=[101 + k], blocks_pulled=3)
            await asyncio.sleep(self.every_s)
        yield decode_service_pb2.DecodeResponse(
            finish_reason=decode_service_pb2.FINISH_REASON_LENGTH
        )


def _stream(host: str, port: int) -> socket.socket:
    body = json.dumps(
        {
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3000,
            "stream": True,
        }
    ).encode()
    sock = socket.create_connection((host, port), timeout=20)
    sock.sendall(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {CLIENT_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    return sock


def _rest(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


# Streaming a token every 20 ms; a token every 3 s (ended between chunks: it was cut, ownfixA
# review, s42); still in prefill (no head sent yet over HTTP: a 503).
@pytest.mark.parametrize("where", ["streaming", "slow", "prefill"])
async def test_answers_a_drain_ran_out_on_end_saying_why(ckpt: Path, where: str) -> None:
    c = await fake_router(ckpt)
    prefill = FakePrefill()
    prefill.hang = where == "prefill"
    await c.add(Role.ENCODER, FakeEncoder())
    await c.add(Role.PREFILL, prefill)
    await c.add(Role.DECODE, Trickle(3.0 if where == "slow" else 0.02))
    assert c.router.http_address is not None
    host, port = c.router.http_address.rsplit(":", 1)
    sock = await asyncio.to_thread(_stream, host, int(port))
    chats = [{"role": "user", "content": "hello"}]
    grpc_answer = asyncio.ensure_future(
        c.client.generate_text(chats, SamplingParams(max_tokens=3000, ignore_eos=True))
    )
    try:
        await asyncio.sleep(0.5)  # both streaming
        assert not grpc_answer.done()
        clean = await c.router.lifecycle.drain(0.3)
        assert not clean
        with pytest.raises(GenerateError) as refused:
            await grpc_answer
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert STOPPING in refused.value.details
        body = await asyncio.to_thread(_rest, sock)
        finished = c.router.orchestrator.metrics.finished
        assert finished.labels("unavailable")._value.get() == 2  # not counted as left
        assert finished.labels("cancelled")._value.get() == 0
    finally:
        sock.close()
        await c.close()
    if where == "prefill":  # nothing sent yet: an error answer
        assert body.startswith(b"HTTP/1.1 503"), body[:200]
        error = json.loads(body.split(b"\r\n\r\n", 1)[1])["error"]
    else:
        assert body.startswith(b"HTTP/1.1 200")
        events = [line for line in body.split(b"\n") if line.startswith(b"data: {")]
        error = json.loads(events[-1][len(b"data: ") :])["error"]
        assert body.endswith(b"0\r\n\r\n"), body[-200:]  # the body's end, not a cut
    assert error["code"] == "unavailable" and STOPPING in error["message"]


class Flood(FakeDecode):
    """A decode worker that sends tokens as fast as its loop allows."""

    async def Decode(self, request: Any, context: Any) -> Any:
        for k in range(request.sampling.max_tokens - 1):
            yield decode_service_pb2.DecodeResponse(token_ids=[101 + k % 50], blocks_pulled=3)
        yield decode_service_pb2.DecodeResponse(
            finish_reason=decode_service_pb2.FINISH_REASON_LENGTH
        )


async def test_a_stream_the_drain_ends_in_grpcs_write_ends_saying_why(ckpt: Path) -> None:
    """An answer written as fast as its client reads is most often in gRPC's write of a chunk
    when the drain runs out: it ends with UNAVAILABLE saying why too, not "Cancelling all
    calls" (the router's handler yielded its chunks, and the cancel landed in gRPC's write,
    outside the code that turns it into the error: 8 of 12 such streams, s45)."""
    for _ in range(3):  # each a fresh router: a drain ends it
        c = await fake_router(ckpt)
        await c.add(Role.ENCODER, FakeEncoder())
        await c.add(Role.PREFILL, FakePrefill())
        await c.add(Role.DECODE, Flood())
        drained: asyncio.Future[bool] | None = None
        try:
            chats = [{"role": "user", "content": "hello"}]
            with pytest.raises(GenerateError) as refused:
                n = 0
                sampling = SamplingParams(max_tokens=30000, ignore_eos=True)
                async for _chunk in c.client.generate(chats, sampling):
                    n += 1
                    if n == 20:
                        drained = asyncio.ensure_future(c.router.lifecycle.drain(0.3))
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert STOPPING in refused.value.details, refused.value.details
            assert drained is not None and not await drained
        finally:
            await c.close()
