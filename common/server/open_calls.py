"""Bounds on the methods anyone may call (`common.server.auth.Need.OPEN`: gRPC health and
reflection), on every server, with or without authentication.

gRPC reads a unary method's request whole, up to `max_message_mb`, before its handler runs,
and the stock health servicer keeps a Watch's request for as long as the stream stays open:
four anonymous Watch calls with 64 MiB service names took a router from 374 MB to 1.5 GB
resident, and two threads sending 200 MiB health checks to 4.9 GB, stalling its event loop
for up to 3 s (security review, s32). A caller needs no credentials for these, so nothing
else bounds them. Here each open method runs as a request-streaming handler, which reads
nothing until asked, and:

- at most `OPEN_READS` of its messages are read at once per server (a read waits up to
  `READ_WAIT_S` for a turn), and a caller that sends none within `READ_S` is ended: what
  gRPC holds for unread calls is bounded by their flow-control windows;
- a message past `OPEN_MESSAGE_BYTES` (a health service name, a reflection symbol, are a
  few dozen bytes) is refused, INVALID_ARGUMENT, before it is parsed;
- at most `OPEN_CALLS` run at once (a Watch or a reflection stream stays open); past that,
  RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from common.server.auth import Need, need_for

OPEN_MESSAGE_BYTES = 64 << 10
OPEN_READS = 4
OPEN_CALLS = 64
READ_WAIT_S = 1.0
READ_S = 10.0


class OpenCallLimits(grpc.aio.ServerInterceptor):
    """Runs each open method's handler within the module docstring's bounds."""

    def __init__(
        self,
        is_open: Callable[[str], bool] = lambda method: need_for(method) is Need.OPEN,
    ) -> None:
        self.is_open = is_open
        self.calls = OPEN_CALLS
        self.message_bytes = OPEN_MESSAGE_BYTES
        self.read_s = READ_S
        self.active = 0  # open calls running
        self._reads = asyncio.Semaphore(OPEN_READS)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not self.is_open(details.method):
            return handler
        method = details.method

        async def bounded(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            await self._serve(handler, method, raw, context)

        return grpc.stream_stream_rpc_method_handler(
            bounded, response_serializer=handler.response_serializer
        )

    async def _serve(
        self,
        handler: grpc.RpcMethodHandler,
        method: str,
        raw: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> None:
        if self.active >= self.calls:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: {self.calls} calls of open methods are running; try again later",
            )
        self.active += 1
        try:
            requests = self._requests(handler.request_deserializer, method, raw, context)
            if handler.request_streaming:
                run = handler.stream_stream or handler.stream_unary
                answer = run(requests, context)
            else:
                request = await anext(requests, None)
                if request is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: no request")
                run = handler.unary_stream or handler.unary_unary
                answer = run(request, context)
            # Written, not yielded: the stock Watch writes its answers itself.
            if inspect.isasyncgen(answer):
                async for message in answer:
                    await context.write(message)
            else:
                message = await answer
                if message is not None:
                    await context.write(message)
        finally:
            self.active -= 1

    async def _requests(
        self,
        parse: Callable[[bytes], Any] | None,
        method: str,
        raw: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Any]:
        """The call's messages, each read in turn (module docstring), checked for size and
        parsed (`parse` None: a unary handler that parses its bytes itself, as
        `common.server.corrupt` makes them)."""
        messages = aiter(raw)
        while True:
            try:
                await asyncio.wait_for(self._reads.acquire(), READ_WAIT_S)
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: too many requests of open methods are being read; try again",
                )
            try:
                data = await asyncio.wait_for(anext(messages, None), self.read_s)
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{method}: no request within {self.read_s:g} s",
                )
            finally:
                self._reads.release()
            if data is None:
                return
            if len(data) > self.message_bytes:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method}: a request of {len(data)} bytes; at most {self.message_bytes}",
                )
            if parse is not None:
                try:
                    data = parse(data)
                except DecodeError as exc:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{method}: the request does not parse: {exc}",
                    )
            yield data
