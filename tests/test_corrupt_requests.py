"""Request bytes that do not parse get INVALID_ARGUMENT on every epd server's unary and
server-streaming methods (`common.server.corrupt`), over real gRPC on 127.0.0.1: they came
back UNKNOWN "Unexpected <class 'DecodeError'>" with an ERROR traceback per call."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import grpc
import pytest

from common.roles import Role
from common.server.rpc import RunningServer, start_server
from epd.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    decode_service_pb2,
    decode_service_pb2_grpc,
)
from router.admin import AdminServicer
from router.registry import Registry
from tests.registry_helpers import MODEL, info


class Decode(decode_service_pb2_grpc.DecodeServiceServicer):
    """Streams two chunks for any request."""

    async def Decode(self, request: Any, context: Any) -> AsyncIterator[Any]:
        for token in (7, 8):
            yield decode_service_pb2.DecodeResponse(token_ids=[token])


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0, expected_model=MODEL)
    registry.register(info(Role.PREFILL, 7001))
    running = await start_server(
        [
            partial(
                admin_service_pb2_grpc.add_AdminServiceServicer_to_server, AdminServicer(registry)
            ),
            partial(decode_service_pb2_grpc.add_DecodeServiceServicer_to_server, Decode()),
        ],
        host="127.0.0.1",
    )
    yield running
    await running.stop(0)


TRUNCATED = b"\x80"  # a varint that never ends
BAD_UTF8 = b"\x0a\x02\xff\xfe"  # DecodeRequest.request_id (a string) of bytes not UTF-8


@pytest.mark.parametrize("raw", [TRUNCATED, BAD_UTF8])
async def test_bytes_that_do_not_parse_are_invalid_argument(
    server: RunningServer, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        status = channel.unary_unary("/epd.v1.AdminService/Status")
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await status(TRUNCATED, timeout=10)
        decode = channel.unary_stream("/epd.v1.DecodeService/Decode")
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            async for _ in decode(raw, timeout=10):
                pass
        # Whole requests are answered as before, a unary and a stream.
        reply = admin_service_pb2.StatusResponse.FromString(
            await status(admin_service_pb2.StatusRequest().SerializeToString(), timeout=10)
        )
        chunks = [c async for c in decode(b"", timeout=10)]
    assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a StatusRequest (corrupt)" in (unary.value.details() or "")
    assert streamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a DecodeRequest (corrupt)" in (streamed.value.details() or "")
    assert [w.info.address for w in reply.workers] == ["127.0.0.1:7001"]
    assert [decode_service_pb2.DecodeResponse.FromString(c).token_ids for c in chunks] == [
        [7],
        [8],
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
