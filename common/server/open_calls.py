"""Bounds on the methods anyone may call (`common.server.auth.Need.OPEN`: gRPC health and
reflection), on every server, with or without authentication.

gRPC reads a unary method's request whole, up to `max_message_mb`, before its handler runs,
and the stock health servicer keeps a Watch's request for as long as the stream stays open:
four anonymous Watch calls with 64 MiB service names took a router from 374 MB to 1.5 GB
resident, and two threads sending 200 MiB health checks to 4.9 GB, stalling its event loop
for up to 3 s (security review, s32). A caller needs no credentials for these, so nothing
else bounds them. Here each open method runs as a request-streaming handler, which reads
nothing until asked, and, per source (the caller's host: one caller cannot take another's
turns, so a kubelet's probes are answered whatever a stranger does):

- at most `READS_PER_SOURCE` of its health requests are read at once, and
  `STREAM_READS_PER_SOURCE` messages of its reflection streams (past that,
  RESOURCE_EXHAUSTED at once): what one source makes a server buffer is at most that many
  `max_message_mb` (5: 1.25 GiB at the default 256 MiB), and reflection streams waiting for
  their next message take no turn of a health check's;
- a call's first message must arrive within `FIRST_MESSAGE_S` (health clients send theirs
  with the call), a reflection stream's next one within `NEXT_MESSAGE_S` (a user's
  think-time; a stream trickling a large message holds its turn no longer);
- a message past `OPEN_MESSAGE_BYTES` (a health service name, a reflection symbol: a few
  dozen bytes) is refused, INVALID_ARGUMENT, before it is parsed, and so never kept;
- at most `STREAMS_PER_SOURCE` Watch and reflection streams stay open at once (past that,
  RESOURCE_EXHAUSTED); a health check is not one of them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from common.server.auth import Need, need_for

OPEN_MESSAGE_BYTES = 64 << 10
READS_PER_SOURCE = 4
STREAM_READS_PER_SOURCE = 1
STREAMS_PER_SOURCE = 16
FIRST_MESSAGE_S = 5.0
NEXT_MESSAGE_S = 60.0


def source_of(peer: str) -> str:
    """The caller's host from gRPC's peer string ("ipv4:10.0.0.7:52344", "ipv6:[::1]:5000",
    "unix:/path"): its calls share one source's turns."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer


class OpenCallLimits(grpc.aio.ServerInterceptor):
    """Runs each open method's handler within the module docstring's bounds."""

    def __init__(
        self, is_open: Callable[[str], bool] = lambda method: need_for(method) is Need.OPEN
    ) -> None:
        self.is_open = is_open
        self.message_bytes = OPEN_MESSAGE_BYTES
        self.reads_per_source = READS_PER_SOURCE
        self.stream_reads_per_source = STREAM_READS_PER_SOURCE
        self.streams_per_source = STREAMS_PER_SOURCE
        self.first_message_s = FIRST_MESSAGE_S
        self.next_message_s = NEXT_MESSAGE_S
        self.reading: Counter[str] = Counter()  # source -> messages being read
        self.streams: Counter[str] = Counter()  # source -> long-lived calls open

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
        source = source_of(context.peer() or "")
        streaming = handler.response_streaming or handler.request_streaming
        with self._counted(self.streams, source) if streaming else nullcontext():
            if streaming and self.streams[source] > self.streams_per_source:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: {self.streams_per_source} streams of open methods from one "
                    "source are open; close one first",
                )
            requests = self._requests(handler, method, source, raw, context)
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

    async def _requests(
        self,
        handler: grpc.RpcMethodHandler,
        method: str,
        source: str,
        raw: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Any]:
        """The call's messages, each read in its source's turn (module docstring), checked
        for size and parsed (no deserializer: a unary handler that parses its bytes itself,
        as `common.server.corrupt` makes them). `raw` is iterated only to read (an iterator
        gRPC made that nobody awaited is a RuntimeWarning)."""
        parse = handler.request_deserializer
        streaming = handler.request_streaming
        turns = f"{source} streams" if streaming else source
        most = self.stream_reads_per_source if streaming else self.reads_per_source
        wait_s = self.first_message_s
        while True:
            with self._counted(self.reading, turns):
                if self.reading[turns] > most:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{method}: {most} requests of open methods from one source are "
                        "being read; try again",
                    )
                try:
                    async with asyncio.timeout(wait_s):
                        data = await anext(raw, None)
                except TimeoutError:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{method}: no request within {wait_s:g} s",
                    )
            wait_s = self.next_message_s
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

    @staticmethod
    @contextmanager
    def _counted(counts: Counter[str], source: str) -> Iterator[None]:
        counts[source] += 1
        try:
            yield
        finally:
            counts[source] -= 1
            if counts[source] <= 0:
                del counts[source]
