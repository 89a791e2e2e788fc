"""Shared gRPC plumbing for every epd server: start, health, errors, channels.

Every worker and the router serve their role service through `start_server`, which also
serves `grpc.health.v1` and gRPC server reflection (`grpc.reflection.v1alpha`: the served
services and their file descriptors, for grpcurl and friends), and applies the same
message-size limits that `channel` uses on the client side. Handlers wrap themselves in
`rpc_errors` so that a bad request becomes a clear status (never a crashed server), and in
`ServerLifecycle.track()` (`common.server.lifecycle`) so that draining refuses new work
while the in-flight work finishes. A role's whole server (registration, drain, ordered stop) is
`common.server.role.RoleServer`; registration itself is `common.server.registrar`.
Authentication (an `Authenticator` given to `start_server`, credentials given to `channel`)
and TLS are `common.server.auth` and `common.server.credentials`; nothing here picks them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from common.errors import FieldError
from common.kv.block_pool import KV_POOL_FULL, NoFreeBlocksError, PoolTooSmallError
from common.server.auth import Authenticator, AuthInterceptor
from common.server.bind import bind_error
from common.server.corrupt import CorruptRequests
from common.server.credentials import NO_CREDENTIALS, ChannelCredentials
from common.server.open_calls import OpenCallLimits
from common.server.transport import (
    DEFAULT_MAX_MESSAGE_MB,
    KEEPALIVE_S,
    channel_options,
    server_options,
)
from common.settings.schema import SettingsError

logger = logging.getLogger(__name__)

# A client-facing port's receive window per call (`start_server`): what a caller can have
# sent that no handler asked for. At 1 ms of round trip it still moves 4 GB/s a call.
CLIENT_STREAM_WINDOW = 4 << 20
DRAINING_DETAILS = "draining"
# The health name a liveness probe checks: SERVING from start to shutdown, whatever "" says.
# "" follows readiness (a router with no worker of some role yet, a draining server), and a
# liveness probe on it would restart a process that is only waiting.
LIVENESS_SERVICE = "liveness"

F = TypeVar("F", bound=Callable[..., Any])


def service_name(pb2_module: Any, service: str) -> str:
    """Full name of `service` in a generated `_pb2` module, e.g. "epd.v1.EncoderService"."""
    return str(pb2_module.DESCRIPTOR.services_by_name[service].full_name)


# --------------------------------------------------------------------------------- server


@dataclass(slots=True, eq=False)
class RunningServer:
    """A started grpc.aio server with its health servicer.

    `stop` is idempotent. The caller owns the server: whoever started it stops it (directly,
    or through `lifecycle.drain()` when one is attached). A role that owns more than the
    server (registrar, background tasks, a NIXL agent) is a `common.server.role.RoleServer`,
    whose `stop` adds those steps around `shutdown`.
    """

    server: Any  # grpc.aio.Server
    health: HealthServicer  # grpc.health.v1 servicer; "" and every service name are listed
    address: str  # "host:port" actually bound (port 0 resolved)
    service_names: tuple[str, ...]  # health names besides "", e.g. "epd.v1.EncoderService"
    stopped: bool = field(default=False)  # set once stop() has begun (unset: `shutdown` failed)

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for "" and every service name (not for
        `LIVENESS_SERVICE`, which says only that the process answers)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Health NOT_SERVING, then stop; RPCs still running after `grace_s` are cancelled."""
        if self.stopped:
            return
        self.stopped = True
        await self.shutdown(grace_s)

    async def shutdown(self, grace_s: float | None) -> None:
        """Health NOT_SERVING, then the gRPC server stops (no idempotence check: see stop).
        One that raised (or was cancelled) leaves `stopped` unset: the server may still
        serve, and the next `stop` (a lifecycle's next drain) runs it again."""
        try:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace_s)
        except BaseException:
            self.stopped = False
            raise

    async def wait_for_termination(self) -> None:
        """Return once the server has stopped."""
        await self.server.wait_for_termination()


async def start_server(
    add_servicers: Sequence[Callable[[Any], None]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    service_names: Sequence[str] = (),
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
    auth: Authenticator | None = None,
    tls: grpc.ServerCredentials | None = None,
    name: str = "server",
    stream_window_bytes: int | None = None,
    keepalive_s: float = KEEPALIVE_S,
    max_connections: int = 0,
) -> RunningServer:
    """Start a grpc.aio server serving the given servicers plus `grpc.health.v1` and
    server reflection (listing `service_names`, health and reflection itself).

    `add_servicers` are callables such as
    `lambda s: encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server(impl, s)`.
    Health reports SERVING for "" and each of `service_names` once started. `port=0` picks a
    free port; the returned `address` carries the real one. The port is never shared: a
    port another server listens on (even another gRPC server, which would otherwise share it
    through SO_REUSEPORT) raises SettingsError "<name> port HOST:PORT is in use ..."; any
    other bind failure raises SettingsError naming `port` too. `auth` (None: every call is
    let through) checks every call's credentials (`common.server.auth`); `tls` (None:
    plaintext) secures the port. `name` ("router", ...) is what the errors call the server.
    Health and reflection, open to anyone, run within `common.server.open_calls`' bounds.

    `keepalive_s`: a client that leaves a ping unanswered this long, sent after this long
    of a call, has its calls cancelled (`common.server.transport`).

    `stream_window_bytes` (None: gRPC's own, grown by bandwidth probing until a call's whole
    message fits) fixes each call's HTTP/2 receive window: a call whose handler has not
    asked for its request then holds at most that much of it here, while the sender waits.
    The router's client port sets it (`router.held`): of sixteen 12.6 MB calls, two read and
    fourteen waiting, the server held 246 MB with the probed window and 131 MB with a 4 MiB
    one; a 100 MiB request took 302 ms against 323 ms over loopback.

    `max_connections` (0: no cap): the connections kept at once (`common.server.transport`,
    with the handshake's time limit).
    """
    # Credentials first: a caller without them learns nothing of what it sent.
    interceptors: list[grpc.aio.ServerInterceptor] = [OpenCallLimits(), CorruptRequests()]
    if auth is not None:
        interceptors.insert(0, AuthInterceptor(auth))
    options = server_options(max_message_mb, keepalive_s, max_connections, stream_window_bytes)
    server = grpc.aio.server(options=options, interceptors=interceptors)
    for add in add_servicers:
        add(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection(
        [*service_names, health_name, reflection.SERVICE_NAME], server
    )
    bare = host.strip("[]")  # "::1" or "[::1]": an IPv6 address is bound in brackets
    shown_host = f"[{bare}]" if ":" in bare else bare
    target = f"{shown_host}:{port}"
    try:
        bound = server.add_secure_port(target, tls) if tls else server.add_insecure_port(target)
    except RuntimeError:  # grpc says only "Failed to bind"; older versions return 0
        bound = 0
    if bound == 0:
        raise SettingsError(bind_error(name, host, port))
    await server.start()
    running = RunningServer(server, health, f"{shown_host}:{bound}", tuple(service_names))
    await running.set_serving(True)
    await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    logger.info("gRPC server on %s (%s)", running.address, ", ".join(service_names) or "-")
    return running


def channel(
    address: str,
    *,
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
    credentials: ChannelCredentials = NO_CREDENTIALS,
    keepalive_s: float | None = KEEPALIVE_S,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` with the shared message-size options, presenting
    `credentials` (default: none, plaintext). Its calls fail with UNAVAILABLE when the peer
    leaves a ping unanswered for `keepalive_s` (None: no pings); its own connections, and a
    peer that went away retried at least every second (`common.server.transport`).

    The caller closes it (`await ch.close()`, or `async with channel(...) as ch`).
    """
    options = channel_options(max_message_mb, keepalive_s)
    return credentials.open(address, options)


async def wait_healthy(
    address: str,
    timeout_s: float = 10.0,
    service: str = "",
    credentials: ChannelCredentials = NO_CREDENTIALS,
) -> None:
    """Poll `grpc.health.v1.Check` until `service` is SERVING; TimeoutError after `timeout_s`.
    Health needs no bearer; `credentials` matter for TLS."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with channel(address, credentials=credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{address} not healthy after {timeout_s}s ({last})")
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(left, 1.0)
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                last = exc.code().name
            await asyncio.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


# --------------------------------------------------------------------------------- errors


class RpcStatusError(Exception):
    """Raise from a handler to answer with an explicit status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class WorkerDrainingError(RpcStatusError):
    """New work refused because the worker drains; maps to UNAVAILABLE "draining"."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, DRAINING_DETAILS)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (grpc.StatusCode, details) an exception escaping a handler maps to.

    RpcStatusError → its code; FieldError (MultimodalLayoutError is one) / SettingsError /
    ValueError → INVALID_ARGUMENT (the message names the field); NoFreeBlocksError →
    RESOURCE_EXHAUSTED, its details opening with `KV_POOL_FULL` (not `PoolTooSmallError`'s,
    which never fits); TimeoutError →
    DEADLINE_EXCEEDED; anything else → INTERNAL.
    """
    if isinstance(exc, RpcStatusError):
        return exc.code, exc.details
    if isinstance(exc, FieldError | SettingsError | ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, PoolTooSmallError):  # never fits this worker: not "full" for now
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, NoFreeBlocksError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{KV_POOL_FULL}: {exc}"
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


MAX_DETAILS = 1024  # characters of an error's details sent (gRPC refuses >16 KiB trailers)


def clipped(details: str, limit: int = MAX_DETAILS) -> str:
    """`details` cut to `limit` characters, saying how long it was: an error that repeats a
    caller's list would otherwise overflow the trailers and reach the caller as
    RESOURCE_EXHAUSTED, without its field. Not within an address: the half of one cut in two
    is none to the router's scrub, and reached clients (chaos5 review, s41), so the
    characters an address may hold before the cut go too (at most `_ADDRESS_CHARS`)."""
    if len(details) <= limit:
        return details
    head = details[: limit - 40]
    if _ADDRESS_CHAR.match(details, limit - 40):  # the cut may be within one
        reached = _ADDRESS_RUN.match(head[: -_ADDRESS_CHARS - 1 : -1])  # read backwards
        head = head[: len(head) - (reached.end() if reached else 0)]
    return f"{head}... ({len(details)} characters)"


_ADDRESS_CHARS = 300  # an address's longest: a 253-character host name and its port
_ADDRESS_CHAR = re.compile(r"[\w.:%/\[\]-]")  # what a host:port ([v6]:port, ipv4:...) holds
_ADDRESS_RUN = re.compile(_ADDRESS_CHAR.pattern + "*")


def logged(name: str, limit: int = 200) -> str:
    """A name a peer sent (a request id, a subscriber), as a log line shows it: cut to
    `limit` characters, what is not printable ASCII escaped, so it cannot forge a line or
    grow the log by its size."""
    return ascii(name[:limit])[1:-1] + ("..." if len(name) > limit else "")


def _where(qualname: str, args: tuple[Any, ...]) -> str:
    """The handler and, where its request carries one, the request id (escaped: it is the
    caller's), so a worker's line matches the router's for that request."""
    request_id = getattr(args[-2], "request_id", "") if len(args) >= 2 else ""
    if not isinstance(request_id, str) or not request_id:
        return qualname
    return f"{qualname} (request {logged(request_id)})"


async def _abort(context: Any, exc: Exception, where: str) -> None:
    code, details = status_for(exc)
    details = clipped(details)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, RpcStatusError):
        logger.exception("%s failed", where)  # a bug: its stack
    elif code == grpc.StatusCode.INTERNAL:  # one the handler named: its words say it all
        logger.error("%s: %s %s", where, code.name, details)
    else:
        logger.info("%s: %s %s", where, code.name, details)
    field = exc.field if isinstance(exc, FieldError) else None  # multimodal or not
    if field is None and code == grpc.StatusCode.INVALID_ARGUMENT:
        named = _NAMED.match(details)  # "kv: missing", "lease_id: ...": the field leads
        field = named.group(1) if named else None
    if field is not None:
        context.set_trailing_metadata((("epd-field", field),))
    await context.abort(code, details)


# A field path leading an INVALID_ARGUMENT's details: "kv.blocks[3].length: ...".
_NAMED = re.compile(r"([A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*): ")


def rpc_errors(fn: F) -> F:
    """Decorate an async unary handler or async-generator streaming handler.

    Exceptions escaping the handler become the status `status_for` gives (the handler's
    last positional argument is the grpc.aio.ServicerContext). `context.abort` inside the
    handler and cancellation pass through untouched. A stream that already yielded
    messages ends with the mapped status after them.
    """
    where = fn.__qualname__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(*args: Any) -> AsyncIterator[Any]:
            try:
                async for message in fn(*args):
                    yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(args[-1], exc, _where(where, args))

        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    async def unary(*args: Any) -> Any:
        try:
            return await fn(*args)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(args[-1], exc, _where(where, args))

    return unary  # type: ignore[return-value]
