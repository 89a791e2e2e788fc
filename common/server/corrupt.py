"""Requests whose bytes do not parse, answered INVALID_ARGUMENT by every epd server.

gRPC parses a unary request (and a server-streaming one's single request) with the
generated deserializer before the handler runs, in its own layer: bytes that do not parse
(truncated, invalid UTF-8 in a string field, groups nested past protobuf's limit) came back
as UNKNOWN "Unexpected <class 'DecodeError'>", named nothing, and logged an ERROR traceback
per call. `CorruptRequests` hands such a method its raw bytes instead and parses them
itself, so that they get INVALID_ARGUMENT "the request is not a PrefillRequest (corrupt):
...", and no log line above INFO. Methods that read their requests themselves (request
streams, the router's Generate) are left as they are.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

logger = logging.getLogger(__name__)


class CorruptRequests(grpc.aio.ServerInterceptor):
    """Parses each unary and server-streaming method's request in the handler (see the
    module docstring). A wrapped handler is made once per method and kept."""

    def __init__(self) -> None:
        self._wrapped: dict[int, grpc.RpcMethodHandler] = {}  # id(original) -> its wrapper
        self._kept: list[grpc.RpcMethodHandler] = []  # the originals, so ids stay theirs

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        parse = getattr(handler, "request_deserializer", None)
        if handler is None or parse is None or handler.request_streaming:
            return handler
        wrapped = self._wrapped.get(id(handler))
        if wrapped is None:
            wrapped = _parsing(handler, parse, details.method)
            self._wrapped[id(handler)] = wrapped
            self._kept.append(handler)
        return wrapped


def _parsing(
    handler: grpc.RpcMethodHandler, parse: Callable[[bytes], Any], method: str
) -> grpc.RpcMethodHandler:
    """`handler`, taking raw bytes and parsing them first."""
    kind = getattr(getattr(parse, "__self__", None), "__name__", "request message")

    async def request_of(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            logger.info("%s: a request that does not parse: %s", method, exc)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a {kind} (corrupt): {exc}"
            )

    serialize = handler.response_serializer
    if not handler.response_streaming:
        unary = handler.unary_unary

        async def one(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await unary(await request_of(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(one, response_serializer=serialize)

    streaming = handler.unary_stream

    async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        answer = streaming(await request_of(raw, context), context)
        if inspect.isasyncgen(answer):
            async for message in answer:
                yield message
        else:  # a coroutine writing with context.write
            await answer

    return grpc.unary_stream_rpc_method_handler(stream, response_serializer=serialize)
