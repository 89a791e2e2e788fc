"""Who may send the HTTP API a body, how large, how fast, and what it holds meanwhile.

`limit_body` is ASGI middleware in front of the app. It reads a request's whole body before
the app runs (the app would read all of it anyway) and replays it:

- a request whose head announces both a Content-Length and a Transfer-Encoding is answered
  400 and the connection closed (which framing a proxy in front read is unknown);
- a head with more than one `Authorization` or `Content-Type` header is answered 400,
  whatever the method: which one a proxy in front checked is unknown (and the endpoints
  read the first, a dict of the head the last);
- only a POST may carry a body (every endpoint that takes one is a POST): any other
  method announcing one (a Content-Length past 0, or Transfer-Encoding) is answered 405
  and the connection closed, its body neither read nor held, whoever sent it;
- a POST from anyone but a client (no valid API key: `identify`) is refused before its
  body is read, so it takes nothing from the budget below (at most 256 KiB of it is read
  and dropped, see the end);
- a POST whose body is compressed (a `Content-Encoding` but `identity`) is answered 415
  before it is read: the server reads JSON as sent;
- a body over `max_bytes` is answered 413: by its Content-Length before a byte of it is
  read, and once the bytes read so far pass the limit, however it is framed;
- the bodies being read or answered are held in `router.held` with the gRPC requests: one
  that would pass its bound (or its tenant's share of it) is answered 429 with Retry-After,
  unless no other request is held (so one request up to `max_bytes` always gets through). A
  body with a Content-Length is held from its head on, as the bytes it announces;
- the whole body must arrive within `timeout_s` (`[router] request_timeout_s`, the time
  gRPC gives a request's read) of its head, else it is answered 408 and the connection
  closed: a client that announces a large body and trickles it, or sends none, would hold
  its bytes of the budget, and a connection, for ever;
- what the app makes of a body (the parsed JSON, the request built from it) it holds beside
  the body's bytes (`BodyHold.more`, refused as above), until the response ends.

A refusal of a request that carries a body reads and drops what is left of it first (no
longer held in the budget above), at most `DRAIN_BYTES` (`DRAIN_ANONYMOUS_BYTES` for a
caller refused its credentials) within `DRAIN_S`, none more once the client pauses
`DRAIN_IDLE_S` (nginx's lingering close, bounded): clients that send their whole body
before reading (Python's http.client, httpx) read the refusal, not a reset connection (a
413 closed at once reached them as BrokenPipeError). Past those bounds, for a larger
announced body, or when the client waits for `100-continue`, the connection is closed after
the answer (`Connection: close`): draining a body of any announced size would cost what the
refusal saved. A refusal for framing or lateness (405, 400 framed twice, 408) closes it at
once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from common.server.auth import ANONYMOUS, Authenticator, Caller, Need
from common.server.credentials import AUTHORIZATION
from router.held import HeldBytes
from router.held import busy as held_busy
from router.http.connections import ConnectionStats
from router.http.errors import ApiError

HELD_KEY = "epd.held"  # ASGI scope: the `BodyHold` of the request's body
# The endpoints that run requests: a refusal here of a request to them counts as one
# (`router.outcomes`).
COUNTED_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))
CALLER_KEY = "epd.caller"  # ASGI scope: who `limit_body` let send a body (POST)
ARRIVED_KEY = "epd.arrived"  # ASGI scope: time.monotonic() once the request's head was read


@dataclass(slots=True)
class BodyHold:
    """What `limit_body` holds in `held` for one request of `tenant`: its body's bytes, and
    what the app adds (`more`); all given back when the response has ended."""

    held: HeldBytes
    tenant: str | None = None
    bytes: int = 0

    def take(self, size: int) -> bool:
        """Hold `size` more bytes if `held` allows (its bound and the tenant's share)."""
        if not self.held.take(size, self.bytes, self.tenant):
            return False
        self.bytes += size
        return True

    def more(self, size: int) -> None:
        """`take`, or the 429 a body over the bound gets (ApiError)."""
        if not self.take(size):
            raise _busy()


def _busy() -> ApiError:
    busy = held_busy("as many requests' bytes as it may")
    return ApiError.from_router(busy.code, str(busy), busy.trailing_metadata)


DRAIN_BYTES = 16 << 20  # most of a refused request's body read and dropped before answering
# ... of a caller refused its credentials: enough for a misconfigured client's request to read
# its 401, not a free 16 MiB read for anyone (gRPC reads none of such a caller's request).
DRAIN_ANONYMOUS_BYTES = 256 << 10
DRAIN_S = 5.0  # and within this long
DRAIN_IDLE_S = 0.5  # nor once the client sends nothing for this long


async def drained(receive: Any, headers: dict[bytes, bytes], most: int = DRAIN_BYTES) -> bool:
    """Read and drop the rest of a refused request's body (module docstring): True when it
    ended within `most` bytes and `DRAIN_S` (the connection may serve another request)."""
    if headers.get(b"expect", b"").lower() == b"100-continue":
        return False  # it sends no body before our answer: none is invited
    length = headers.get(b"content-length", b"")
    if length.isdigit() and int(length) > most:
        return False
    got = 0
    try:
        async with asyncio.timeout(DRAIN_S):
            while got <= most:
                async with asyncio.timeout(DRAIN_IDLE_S):
                    message = await receive()
                if message["type"] != "http.request":
                    return False  # the client went away
                got += len(message.get("body", b""))
                if not message.get("more_body"):
                    return True
    except TimeoutError:
        pass
    return False


# Headers a request may carry once: two are read differently by different readers.
SINGLE_HEADERS = (b"authorization", b"content-type")


def named_twice(raw: Any) -> str | None:
    """The first of `SINGLE_HEADERS` that the ASGI head `raw` names more than once."""
    names = [name for name, _ in raw if name in SINGLE_HEADERS]
    return next((n.decode() for n in SINGLE_HEADERS if names.count(n) > 1), None)


def compressed(raw: Any) -> str | None:
    """The content coding the ASGI head `raw` announces, other than `identity`."""
    codings = (
        coding.strip().lower()
        for name, value in raw
        if name == b"content-encoding"
        for coding in value.decode("latin-1").split(",")
    )
    return next((c for c in codings if c not in ("", "identity")), None)


def carries_body(headers: dict[bytes, bytes]) -> bool:
    """Whether a request head announces a body: a Content-Length past 0, or chunked."""
    if b"transfer-encoding" in headers:
        return True
    length = headers.get(b"content-length", b"0")
    return not length.isdigit() or int(length) > 0


def identify(auth: Authenticator | None, header: str | None, need: Need = Need.CLIENT) -> Caller:
    """The caller an `Authorization` header names, who may do what needs `need` (a client
    key, or an admin one); ApiError (401, 403) for anyone else."""
    if auth is None:
        return ANONYMOUS
    found = auth.identify([(AUTHORIZATION, header)] if header else [])
    if found is None:
        raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "needs a valid API key (Bearer)")
    if not found.satisfies(need):
        key = "an admin" if need is Need.ADMIN else "a client"
        raise ApiError(grpc.StatusCode.PERMISSION_DENIED, f"needs {key} API key")
    return found


class _Refused(Exception):
    """The body is answered with `error` instead of reaching the app."""

    def __init__(self, error: ApiError, ended: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.ended = ended  # the body's last message was read already


def limit_body(
    app: Any, max_bytes: int, held: HeldBytes, timeout_s: float, stats: ConnectionStats
) -> Any:
    """`app` behind the bounds of this module's docstring (408s counted in `stats`)."""
    too_large = ApiError(
        grpc.StatusCode.INVALID_ARGUMENT, f"body over {max_bytes} bytes (max_message_mb)"
    )
    too_large.status = 413
    late = ApiError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the request body did not arrive within {timeout_s:g} s (request_timeout_s)",
    )
    late.status = 408
    not_post = ApiError(grpc.StatusCode.INVALID_ARGUMENT, "only a POST request may carry a body")
    not_post.status = 405
    framed_twice = ApiError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "a request may not carry both Content-Length and Transfer-Encoding",
    )
    full = _busy()

    async def read(receive: Any, announced: int | None, hold: BodyHold) -> list[Any]:
        """The request's ASGI messages up to the body's end (or the client's going), its
        bytes held in `hold` (all at once when `announced`)."""
        if announced is not None:
            if announced > max_bytes:
                raise _Refused(too_large)
            if not hold.take(announced):  # the HTTP server reads no more than it says
                raise _Refused(full)
        # The body's pieces, replayed as one message: a body sent in 100k small writes was
        # 100k messages, replayed by list.pop(0) in one task step, 1.0 s (stalls review).
        pieces: list[bytes] = []
        received = 0  # the body's bytes so far, however it is framed
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees it
                return [
                    {"type": "http.request", "body": b"".join(pieces), "more_body": True},
                    message,
                ]
            pieces.append(message.get("body", b""))
            received += len(pieces[-1])
            ended = not message.get("more_body")
            if received > max_bytes or (announced is not None and received > announced):
                raise _Refused(too_large, ended)
            if announced is None and not hold.take(received - hold.bytes):
                raise _Refused(full, ended)
            if ended:
                return [{"type": "http.request", "body": b"".join(pieces), "more_body": False}]

    async def limited(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        scope[ARRIVED_KEY] = time.monotonic()  # TTFT's start: its body's upload counts
        raw = scope.get("headers", ())
        headers = dict(raw)
        length = headers.get(b"content-length")
        hold = BodyHold(held)
        try:
            try:
                if scope.get("method") != "POST" and carries_body(headers):
                    raise _Refused(not_post)  # not read: nobody's bytes to hold
                if b"transfer-encoding" in headers and length is not None:
                    raise _Refused(framed_twice)  # RFC 9112 6.3: framed one way or the other
                twice = named_twice(raw)
                if twice is not None:
                    message = f"the request carries more than one {twice.title()} header"
                    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)
                if scope.get("method") == "POST":  # a body: only a client may have one read
                    header = headers.get(b"authorization")
                    caller = identify(app.state.auth, header.decode("latin-1") if header else None)
                    scope[CALLER_KEY] = caller
                    hold.tenant = caller.tenant
                    coding = compressed(raw)
                    if coding is not None:
                        unsupported = ApiError(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"Content-Encoding {coding} is not supported: send the body "
                            "uncompressed",
                        )
                        unsupported.status = 415
                        raise unsupported
                announced = int(length) if length is not None and length.isdigit() else None
                try:
                    async with asyncio.timeout(timeout_s):
                        messages = await read(receive, announced, hold)
                except TimeoutError:
                    raise _Refused(late) from None
            except (ApiError, _Refused) as exc:
                error = exc.error if isinstance(exc, _Refused) else exc
                response = error.response()
                count = getattr(app.state, "refused", None)
                counted = scope.get("path") in COUNTED_PATHS  # a request to run, not /health
                if CALLER_KEY in scope and count is not None and counted:  # accepted caller
                    count(scope[CALLER_KEY].tenant, error.grpc_code, str(error))
                ended = isinstance(exc, _Refused) and exc.ended
                if carries_body(headers) and not ended:  # unread, or read in part
                    held.give(hold.bytes, hold.tenant)  # dropped: none held while draining
                    hold.bytes = 0
                    closing = error in (late, not_post, framed_twice)
                    most = DRAIN_BYTES if CALLER_KEY in scope else DRAIN_ANONYMOUS_BYTES
                    if closing or not await drained(receive, headers, most):
                        response.headers["Connection"] = "close"
                if error is late:
                    stats.closed_body_late += 1
                await response(scope, receive, send)
                return

            async def replay() -> Any:  # one or two messages (`read`)
                return messages.pop(0) if messages else await receive()

            scope[HELD_KEY] = hold
            await app(scope, replay, send)
        finally:
            held.give(hold.bytes, hold.tenant)

    return limited
