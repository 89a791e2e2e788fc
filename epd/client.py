"""Python client of the epd router: chat messages in, streamed text out.

    async with Client("127.0.0.1:50051") as client:
        async for chunk in client.generate(messages, SamplingParams(max_tokens=32)):
            print(chunk.text, end="")

    result = generate_text("127.0.0.1:50051", messages)   # blocking, whole answer

Messages are OpenAI-like: `{"role": "user", "content": str | [parts]}` with parts
`{"type": "text", "text": ...}`, `{"type": "image", "image": src}` and
`{"type": "video", "video": video, "fps": float}`. An image `src` is encoded file bytes
(sent as they are), a path (the file's bytes), a PIL image or an `(H, W[, C])` uint8 array
(both sent as PNG, lossless). A video is a video file (mp4, webm, mkv: a path, or the file's
bytes), which the router decodes and samples at `fps` (optional: the router's default), or
frames at `fps` frames per second (required): a folder of frame images (a path, read in name
order), a list of image sources or a `(T, H, W, C)` uint8 array. `"uuid"` on a media part
is the caller's identity for it. Data URLs (`{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`) work too.

Every call presents an API key (`authorization: Bearer KEY`): `api_key=...`, else
$EPD_API_KEY, else the client key `epd serve` wrote ($EPD_HOME/<namespace>/client_key, default
~/.epd/epd/client_key). The key's tenant owns the request's caches: a `cache_salt` only splits
that tenant's cache further. A router serving TLS is reached with `tls_ca_file` (the CA that
signed its certificate); no client certificate is needed.

The wire form of a chat (`build_request`, media encoding) is `epd.request`; its names are
importable from here too.

Several routers: `Client(["host1:50051", "host2:50051"])` (or one string "a,b", as
$EPD_ROUTER may hold) spreads requests over them, each request starting on the next router
in turn (one that did not connect within the last `DOWN_S`, `epd.routers`, last). A stream
that fails with UNAVAILABLE (the router died, drains or cannot be reached; one not connected within
`CONNECT_S` while others are left counts so) goes on at the next router, once at each:
from the start if nothing had come, else resumed after the tokens received
(`GenerateRequest.resume_tokens`); a request with `stop` strings is not resumed. With one
address, one refused "draining" is sent once more on a new connection (a load balancer's).
When no router is left, `GenerateError` says which were tried. A stream that fails after
its last chunk (the one with a finish reason) is not sent again: the caller has it whole.

Failures raise `GenerateError` with the gRPC status code and the router's message
(UNAUTHENTICATED: no or an unknown key; PERMISSION_DENIED: the key may not do that).
A router that is full refuses a request with RESOURCE_EXHAUSTED and says when to try again
(`retry-after-ms`); with `Client(..., max_retries=N)` such a request, or a stream's resume,
is sent again up to N times, each after that wait (within the request's timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc

from common.sampling import SamplingParams
from common.server.credentials import ChannelCredentials, bearer_metadata, checked_key, read_ca
from common.server.rpc import DRAINING_DETAILS, channel
from common.server.transport import DEFAULT_MAX_MESSAGE_MB
from common.settings.api_keys import CLIENT_KEY_FILE, default_api_key
from epd.answers import Chunk, GenerateError, Result, chunk_of, collected, retry_after_s
from epd.request import (
    IMAGE_SUFFIXES,
    Messages,
    build_request,
    checked_timeout,
    encode_image,
    frame_files,
)
from epd.request import video_input as video_input
from epd.routers import CONNECT_S, Routers, Turns, connects, router_list
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc, router_service_pb2_grpc

__all__ = [  # `epd.request`'s and `epd.answers`' public names too
    "IMAGE_SUFFIXES",
    "Routers",
    "Chunk",
    "Client",
    "GenerateError",
    "Messages",
    "Result",
    "build_request",
    "encode_image",
    "frame_files",
    "generate",
    "generate_text",
    "video_input",
]


CLOSED = "the client was closed while the stream ran"
DRAINED_GRACE_S = 3600.0  # a connection left by `_reopen` closes at the latest after this


class Client:
    """Connections to one or more routers, reused across requests (module docstring). Close
    it (or use `async with`)."""

    def __init__(
        self,
        address: Routers,
        *,
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        api_key: str | None = None,
        tls_ca_file: str | Path | None = None,
        max_retries: int = 0,
        keepalive_s: float | None = None,
    ) -> None:
        """`address`: the router, or several (a list, or one comma-separated string);
        `api_key`: presented on every call (None: $EPD_API_KEY or `epd serve`'s client
        key file, see the module docstring); `tls_ca_file`: dial TLS, verifying the routers
        with this PEM CA (None: plaintext); `max_retries`: times a request the router
        refused as full (RESOURCE_EXHAUSTED) is sent again after the wait it names;
        `keepalive_s`: a router that leaves an HTTP/2 ping unanswered this long, sent after
        this long of a call, fails the call, which goes on on the next router (a frozen
        process, a lost network path). None: no pings, as routers from before they were
        taken, and gRPC servers and proxies in general, answer a third ping without data
        within 5 minutes by closing the connection ("too many pings")."""
        if max_retries < 0:
            raise ValueError(f"max_retries must not be negative, got {max_retries}")
        if keepalive_s is not None and not 0.1 <= keepalive_s <= 3600:  # gRPC's C int of ms
            raise ValueError(f"keepalive_s must be None or 0.1 to 3600 s, got {keepalive_s}")
        self.max_retries = max_retries
        self.max_bytes = max_message_mb << 20  # what one request may take (`build_request`)
        self.addresses = router_list(address)  # every router, in the order given
        self.address = self.addresses[0]  # the first (Status asks this one)
        credentials = ChannelCredentials(
            checked_key(api_key) if api_key is not None else default_api_key(CLIENT_KEY_FILE),
            root_certificates=read_ca(tls_ca_file) if tls_ca_file else None,
            tls=bool(tls_ca_file),  # "" (an empty $EPD_TLS_CA_FILE): plaintext, as None
        )
        # Opened at first use, in the loop using them, each with its own connections.
        self._open_one = lambda a: channel(
            a, max_message_mb=max_message_mb, credentials=credentials, keepalive_s=keepalive_s
        )
        self._open = lambda: [self._open_one(a) for a in self.addresses]
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}  # left by `_reopen`
        self._opened: list[grpc.aio.Channel] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop they were opened in
        self._stubs: list[router_service_pb2_grpc.RouterServiceStub] = []
        self._turns = Turns(len(self.addresses))  # the router each request starts on
        self._closes = 0  # `close` calls
        self.retries = 0  # requests sent again to another router (pre-first-chunk failures)
        self.resumes = 0  # streams resumed on another router after their router failed
        self.busy_retries = 0  # requests sent again after a RESOURCE_EXHAUSTED's wait

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _channels(self) -> list[grpc.aio.Channel]:
        """One channel per router, opened at first use in each event loop (a second
        `asyncio.run` found the first one's closed loop under them)."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if self._opened is None or self._loop is not loop:
            self._loop = loop
            self._opened = self._open()
            self._stubs = [router_service_pb2_grpc.RouterServiceStub(c) for c in self._opened]
        return self._opened

    @property
    def _routers(self) -> list[router_service_pb2_grpc.RouterServiceStub]:
        _ = self._channels  # opened
        return self._stubs

    @property
    def _router(self) -> router_service_pb2_grpc.RouterServiceStub:  # (tests send raw requests)
        return self._routers[0]

    async def close(self) -> None:
        """Close the channels; running streams end with GenerateError (CANCELLED)."""
        self._closes += 1  # a stream waiting to send again stops (`_closed_since`)
        for ch in self._opened or ():
            await ch.close()
        self._opened = None
        for old in list(self._closing.values()):
            await old.close()

    def _reopen(self, index: int, used: grpc.aio.Channel) -> None:
        """A new connection to `index` (a load balancer sends it elsewhere; on the one kept
        a draining router refused each request; deploy review); the old one, `used` (unless
        closed or reopened since), closes once its calls end."""
        if self._opened is None or self._opened[index] is not used:
            return
        old, self._opened[index] = self._opened[index], self._open_one(self.addresses[index])
        self._stubs[index] = router_service_pb2_grpc.RouterServiceStub(self._opened[index])
        task = asyncio.ensure_future(old.close(grace=DRAINED_GRACE_S))
        self._closing[task] = old
        task.add_done_callback(self._closing.pop)

    async def generate(
        self,
        messages: Messages,
        sampling: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        request_id: str = "",
        cache_salt: str | None = None,
        api_key: str | None = None,
        stop: str | Sequence[str] = (),
    ) -> AsyncIterator[Chunk]:
        """Stream the answer to a chat. Closing the stream cancels the request on the
        router, which frees what the workers hold for it: cancelling the task, or leaving
        `async for chunk in client.generate(...)` early, closes it at once; a stream kept in
        a variable is closed by `await stream.aclose()` (or `contextlib.aclosing`), else
        only when it is garbage-collected, and the router generates on meanwhile. `api_key`
        overrides the client's key for this request; the answer ends before the first of
        the `stop` strings (finish reason "stop"); `timeout_s`: None or infinity for none.
        Raises `GenerateError`; `ValueError` for messages that cannot be sent or a timeout
        that is not a positive number. Several routers: the module doc (a resumed answer is
        token for token the same where greedy or seeded, in float32)."""
        request = build_request(
            messages,
            sampling,
            request_id=request_id,
            cache_salt=cache_salt,
            stop=stop,
            max_bytes=self.max_bytes,
        )
        metadata = bearer_metadata(checked_key(api_key)) if api_key is not None else None
        timeout_s = checked_timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failures: list[str] = []
        received: list[int] = []  # tokens of the answer the caller has
        finished = False  # the caller has the chunk with the finish reason: the whole answer
        busy = 0  # RESOURCE_EXHAUSTED refusals sent again
        order = self._turns.order()
        attempt, closes, reopened = 0, self._closes, False
        while attempt < len(order):
            if self._closes != closes:  # closed while it waited to send again: not reopened
                raise GenerateError(grpc.StatusCode.CANCELLED, CLOSED)
            index = order[attempt]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                gone = attempt + 1 < len(order) and not await connects(self._channels[index], left)
            except grpc.aio.UsageError:  # "Channel is closed": close() while it connected
                raise GenerateError(grpc.StatusCode.CANCELLED, CLOSED) from None
            if gone:
                failures.append(f"{self.addresses[index]}: did not connect in {CONNECT_S:g} s")
                self._turns.down(index)
                self.resumes += bool(received)
                self.retries += not received
                attempt += 1
                continue
            del request.resume_tokens[:]
            request.resume_tokens.extend(received)
            resuming = len(received)  # the first chunk must say it took them
            used = self._channels[index]  # the connection it goes on (`_reopen`)
            call = self._routers[index].Generate(request, timeout=left, metadata=metadata)
            try:
                async for response in call:
                    if resuming and response.resumed_tokens != resuming:
                        # A router older than `resume_tokens` answers from the start, one
                        # older than `resumed_tokens` resumes without saying so: the caller
                        # would read the answer's beginning twice, or cannot tell it won't.
                        raise GenerateError(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"router {self.addresses[index]} did not say it resumed the "
                            f"stream (older than this client): the answer stops after "
                            f"{resuming} tokens",
                        )
                    resuming = 0
                    received.extend(response.token_ids)
                    finished = finished or bool(response.finish_reason)  # not UNSPECIFIED
                    yield chunk_of(response)
                return
            except asyncio.CancelledError:  # the caller's, or gRPC's for a closed channel
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise
                raise GenerateError(grpc.StatusCode.CANCELLED, CLOSED) from None
            except grpc.aio.AioRpcError as exc:
                if finished:  # only the final status was lost (the router died after it)
                    return
                code, details = exc.code(), exc.details() or ""
                wait = retry_after_s(exc) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if wait is not None and self._may_wait(
                    busy, bool(received and stop), wait, deadline
                ):
                    busy += 1
                    self.busy_retries += 1
                    await asyncio.sleep(wait)
                    continue  # the same router, which said when
                drained = code == grpc.StatusCode.UNAVAILABLE and details == DRAINING_DETAILS
                if drained and not received and not reopened and len(self.addresses) == 1:
                    reopened = True  # nothing started: on a new connection, a load balancer's
                    self._reopen(index, used)
                    continue
                if len(self.addresses) == 1:
                    raise GenerateError.of(exc) from None
                where = f"{self.addresses[index]}: {code.name} {details}".strip()
                if code != grpc.StatusCode.UNAVAILABLE or (received and stop):
                    after = f" after {len(received)} tokens (not resumed)" if received else ""
                    raise GenerateError.of(exc, f"router {where}{after}") from None
                failures.append(where)
                if attempt + 1 < len(self.addresses):
                    if received:
                        self.resumes += 1
                    else:
                        self.retries += 1
                attempt += 1
            finally:
                call.cancel()
        failed = "; ".join(failures)
        raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"every router failed: {failed}")

    def _may_wait(self, busy: int, unresumable: bool, wait: float, deadline: float | None) -> bool:
        """Whether a refusal (RESOURCE_EXHAUSTED, `wait` s) is sent again (as it was, or
        resumed after the tokens received): retries left, not `unresumable` (stop strings
        and tokens), and the wait ends before the deadline."""
        if busy >= self.max_retries or unresumable:
            return False
        return deadline is None or time.monotonic() + wait < deadline

    async def generate_text(
        self,
        messages: Messages,
        sampling: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        request_id: str = "",
        cache_salt: str | None = None,
        api_key: str | None = None,
        stop: str | Sequence[str] = (),
    ) -> Result:
        """The whole answer to a chat, with timings (`api_key`, `stop`: as in `generate`)."""
        stream = self.generate(
            messages,
            sampling,
            timeout_s=timeout_s,
            request_id=request_id,
            cache_salt=cache_salt,
            api_key=api_key,
            stop=stop,
        )
        return await collected(stream)

    async def status(self, *, timeout_s: float = 10.0) -> admin_service_pb2.StatusResponse:
        """The router's AdminService.Status (every worker with its last load); needs an
        admin key (PERMISSION_DENIED otherwise)."""
        try:
            admin = admin_service_pb2_grpc.AdminServiceStub(self._channels[0])
            response: admin_service_pb2.StatusResponse = await admin.Status(
                admin_service_pb2.StatusRequest(), timeout=checked_timeout(timeout_s)
            )
        except grpc.aio.AioRpcError as exc:
            raise GenerateError.of(exc) from None
        return response


async def generate(
    address: Routers,
    messages: Messages,
    sampling: SamplingParams | None = None,
    *,
    timeout_s: float | None = None,
    api_key: str | None = None,
    tls_ca_file: str | Path | None = None,
    stop: str | Sequence[str] = (),
) -> AsyncIterator[Chunk]:
    """`Client.generate` on a connection of its own, closed when the stream ends."""
    async with Client(address, api_key=api_key, tls_ca_file=tls_ca_file) as client:
        async for chunk in client.generate(messages, sampling, timeout_s=timeout_s, stop=stop):
            yield chunk


def generate_text(
    address: Routers,
    messages: Messages,
    sampling: SamplingParams | None = None,
    *,
    timeout_s: float | None = None,
    api_key: str | None = None,
    tls_ca_file: str | Path | None = None,
    stop: str | Sequence[str] = (),
) -> Result:
    """Blocking: the whole answer to one chat (runs its own event loop; do not call it from
    inside one, use `Client.generate_text` there). `api_key`, `tls_ca_file`: as `Client`'s;
    `stop`: as `Client.generate`'s."""

    async def run() -> Result:
        async with Client(address, api_key=api_key, tls_ca_file=tls_ca_file) as client:
            return await client.generate_text(messages, sampling, timeout_s=timeout_s, stop=stop)

    return asyncio.run(run())
