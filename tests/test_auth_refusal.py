"""A call refused for its credentials is refused without reading its request: gRPC takes in
a unary method's request whole before its handler runs, so a refusal of that kind first
held up to `max_message_mb` for a caller without credentials (four anonymous 200 MB
Generate calls took a router from 264 MB to 1.46 GB resident; now 279 MB).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from common.server.auth import Authenticator, RefusalLog
from common.server.rpc import RunningServer, start_server
from epd.v1 import router_service_pb2

KEY_SECRET = "cluster-secret-for-this-test"
GENERATE = "/epd.v1.RouterService/Generate"


class Counting:
    """A Generate behind a deserializer that counts the requests it decoded."""

    def __init__(self) -> None:
        self.decoded = 0
        self.answered = 0

    def deserialize(self, data: bytes) -> router_service_pb2.GenerateRequest:
        self.decoded += 1
        return router_service_pb2.GenerateRequest.FromString(data)

    async def generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.answered += 1
        yield router_service_pb2.GenerateResponse(text="ok")

    def add(self, server: Any) -> None:
        handler = grpc.unary_stream_rpc_method_handler(
            self.generate,
            request_deserializer=self.deserialize,
            response_serializer=router_service_pb2.GenerateResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("epd.v1.RouterService", {"Generate": handler}),)
        )


@pytest.fixture
async def served() -> AsyncIterator[tuple[RunningServer, Counting]]:
    counting = Counting()
    server = await start_server([counting.add], auth=Authenticator(KEY_SECRET))
    yield server, counting
    await server.stop(0)


async def generate(address: str, request: Any, bearer: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {bearer}"),) if bearer else None
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as ch:
        call = ch.unary_stream(
            GENERATE,
            request_serializer=router_service_pb2.GenerateRequest.SerializeToString,
            response_deserializer=router_service_pb2.GenerateResponse.FromString,
        )(request, metadata=metadata, timeout=30)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_a_refused_call_is_not_read(served: tuple[RunningServer, Counting]) -> None:
    server, counting = served
    big = router_service_pb2.GenerateRequest(request_id="x", prompt="y" * (16 << 20))
    for bearer in (None, "not-the-secret"):
        assert await generate(server.address, big, bearer) == grpc.StatusCode.UNAUTHENTICATED
    assert (counting.decoded, counting.answered) == (0, 0)
    # The cluster bearer is a service: the router's Generate needs a client key, and that
    # refusal (PERMISSION_DENIED) reads nothing either.
    assert await generate(server.address, big, KEY_SECRET) == grpc.StatusCode.PERMISSION_DENIED
    assert counting.decoded == 0


async def test_refused_calls_are_logged_a_line_per_kind_a_minute(
    served: tuple[RunningServer, Counting], caplog: pytest.LogCaptureFixture
) -> None:
    # A line each: one client without credentials grew a server's log by ~300 KB/s (s41
    # attacker3 F2).
    server, _ = served
    small = router_service_pb2.GenerateRequest(request_id="x", prompt="y")
    with caplog.at_level(logging.INFO, logger="common.server.auth"):
        for _ in range(20):
            assert await generate(server.address, small, None) == grpc.StatusCode.UNAUTHENTICATED
        await generate(server.address, small, KEY_SECRET)  # another kind: its own first line
    assert [r.getMessage() for r in caplog.records] == [
        f"refused {GENERATE}: UNAUTHENTICATED",
        f"refused {GENERATE}: PERMISSION_DENIED",
    ]


def test_a_refusal_log_says_how_many_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RefusalLog(every_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="common.server.auth"):
        for t in range(0, 130, 2):  # a refusal every 2 s for 128 s
            now[0] = float(t)
            log(GENERATE, grpc.StatusCode.UNAUTHENTICATED)
    assert [r.getMessage() for r in caplog.records] == [
        f"refused {GENERATE}: UNAUTHENTICATED",
        f"refused {GENERATE}: UNAUTHENTICATED (and 29 more since 60 s ago)",
        f"refused {GENERATE}: UNAUTHENTICATED (and 29 more since 60 s ago)",
    ]


def test_a_burst_that_stops_is_counted_at_its_window_end(caplog: pytest.LogCaptureFixture) -> None:
    now, due = [0.0], []
    log = RefusalLog(every_s=60.0, clock=lambda: now[0], later=lambda s, f: due.append((s, f)))
    with caplog.at_level(logging.INFO, logger="common.server.auth"):
        for t in range(0, 10):  # ten refusals in 9 s, then none
            now[0] = float(t)
            log(GENERATE, grpc.StatusCode.UNAUTHENTICATED)
        assert [s for s, _ in due] == [59.0]  # one line arranged, at the window's end
        now[0] = 60.0
        due.pop()[1]()
        now[0] = 200.0  # the next window left nothing out: its line has nothing to say
        log(GENERATE, grpc.StatusCode.UNAUTHENTICATED)
    assert [r.getMessage() for r in caplog.records] == [
        f"refused {GENERATE}: UNAUTHENTICATED",
        f"refused {GENERATE}: UNAUTHENTICATED (and 9 more since 60 s ago)",
        f"refused {GENERATE}: UNAUTHENTICATED",
    ]


def test_a_window_end_says_nothing_once_a_refusal_said_it(caplog: pytest.LogCaptureFixture) -> None:
    now, due = [0.0], []
    log = RefusalLog(every_s=60.0, clock=lambda: now[0], later=lambda s, f: due.append((s, f)))
    with caplog.at_level(logging.INFO, logger="common.server.auth"):
        for t in (0.0, 5.0, 61.0, 62.0):
            now[0] = t
            log(GENERATE, grpc.StatusCode.UNAUTHENTICATED)
        due[0][1]()  # late: the refusal at 61 s said the count; 62 s is the new window's
    assert [r.getMessage() for r in caplog.records] == [
        f"refused {GENERATE}: UNAUTHENTICATED",
        f"refused {GENERATE}: UNAUTHENTICATED (and 1 more since 61 s ago)",
    ]
    now[0] = 121.0
    with caplog.at_level(logging.INFO, logger="common.server.auth"):
        due[1][1]()  # the window begun at 61 s ends: the refusal at 62 s
    assert caplog.records[-1].getMessage() == (
        f"refused {GENERATE}: UNAUTHENTICATED (and 1 more since 60 s ago)"
    )


async def test_a_window_end_is_arranged_on_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    log = RefusalLog(every_s=0.05)
    with caplog.at_level(logging.INFO, logger="common.server.auth"):
        log(GENERATE, grpc.StatusCode.UNAUTHENTICATED)
        log(GENERATE, grpc.StatusCode.UNAUTHENTICATED)
        await asyncio.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"refused {GENERATE}: UNAUTHENTICATED"
    assert lines[1].startswith(f"refused {GENERATE}: UNAUTHENTICATED (and 1 more since ")
    assert len(lines) == 2
