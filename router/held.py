"""The bytes of requests the router holds at once, over both front doors
(`[router] requests_in_flight_mb`).

A request stays in memory until its answer ends (its media are decoded from it, and their
patch rows travel with it), so without a bound many clients, each sending a request up to
`max_message_mb`, could together hold any amount of the router's memory. One `HeldBytes`
counts them all: the HTTP API takes a body's bytes as it reads them
(`router.http.body.limit_body`), and Generate takes the size of the bytes its request was
decoded from (`Sized`, from `decode_request`; measuring the decoded message would serialize
it again: 0.22 s for a 200 MB request). A request's media
count too (`MediaHold`), often many times its bytes: what they decode to, reserved from
their headers before any is decoded, then, once processed, their patch codes.

A request that would pass the bound is refused (HTTP 429 with Retry-After, gRPC
RESOURCE_EXHAUSTED with `retry-after-ms`) unless no other request is held, so one request of
up to `max_message_mb` always gets through.

gRPC would read and decode a unary method's request before its handler runs, refused or
not, so a burst of large calls would all be in memory at once before any refusal: sixteen
12.6 MB Generate calls took a router from 266 to 854 MB resident with a 64 MiB bound. So
Generate is served as a request-streaming method (the same bytes on the wire; clients call
it as ever), and its handler reads the request only once one of `reads` is free: at most
bound / `max_message_mb` requests (at least one) are being read at once. A request is read
in the time its bytes take to arrive, so small ones hardly wait. A call waiting for its read
holds at most its receive window (`common.server.rpc.CLIENT_STREAM_WINDOW`, 4 MiB), and at
most bound / window calls (at least one) may wait: one more is refused at once. Everything
here runs on the router's event loop, but decoding a request's bytes (`decode_request`).

Tenants (`[router] tenant_share`, where the API keys name more than one with client keys;
`epd serve`'s own keys are one client tenant and an admin one): one tenant holds
at most that share of the bytes and of the read slots (at least one), so a tenant that sends
large requests slowly, or announces HTTP bodies it does not send, cannot take every read or
all of the bound from the others. Its bytes past its share are refused as the bound's are,
unless no other request of that tenant holds any; its reads past its share wait, in at
most its share of the places to wait (past those: refused at once, as past all of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from common.errors import FieldError
from common.processing.prompt import ProcessedPrompt
from common.server.rpc import CLIENT_STREAM_WINDOW
from epd.v1 import router_service_pb2
from router.calls import Refused, RouterError
from router.request_bytes import Sized, decode_request

SERVICE = "epd.v1.RouterService"
RETRY_AFTER_S = 1.0  # the back-off a refusal suggests
CORRUPT = object()  # `read_request`: the bytes sent do not decode


class HeldBytes:
    """Bytes of the requests being read or answered, at most `limit` (0: no bound), and
    of each tenant at most `tenant_share` of it (1: no per-tenant bound)."""

    def __init__(
        self,
        limit: int,
        max_request: int = 1,
        window: int = CLIENT_STREAM_WINDOW,
        tenant_share: float = 1.0,
    ) -> None:
        self.limit = limit
        self.held = 0  # bytes held now
        self.refused = 0  # requests refused for the bound, ever (`epd:requests_refused_held`)
        # gRPC requests, each up to `max_request` bytes, that may be being read at once,
        # and calls that may wait for a read, each holding up to `window` bytes meanwhile.
        slots = max(1, limit // max_request) if limit else 1 << 30
        self.reads = asyncio.Semaphore(slots)
        self.max_waiting = max(1, limit // window) if limit else 1 << 30
        self.waiting = 0  # calls waiting for a read now
        # One tenant's bytes and read slots at most (0: no per-tenant bound),
        self.tenant_limit = int(limit * tenant_share) if limit and tenant_share < 1 else 0
        self.tenant_reads = max(1, int(slots * tenant_share)) if self.tenant_limit else 0
        # and places to wait for a read.
        self.tenant_waiting = (
            max(1, int(self.max_waiting * tenant_share)) if self.tenant_limit else 0
        )
        self.by_tenant: dict[str, int] = {}  # bytes held now per tenant (with a tenant limit)
        self._reads_of: dict[str, _TenantReads] = {}  # tenants with calls reading or waiting
        self._lock = threading.Lock()  # `take` and `give`

    def take(self, size: int, mine: int = 0, tenant: str | None = None) -> bool:
        """Hold `size` more bytes for a request of `tenant` that holds `mine` already, if
        the bound allows (always when no other request holds any) and the tenant's share
        does (always when no other request of the tenant holds any). (Any thread, as
        `give`: media are reserved on the thread that reads them.)"""
        with self._lock:
            if self.limit and self.held > mine and self.held + size > self.limit:
                self.refused += 1
                return False
            if self.tenant_limit and tenant is not None:
                ours = self.by_tenant.get(tenant, 0)
                if ours > mine and ours + size > self.tenant_limit:
                    self.refused += 1
                    return False
                self.by_tenant[tenant] = ours + size
            self.held += size
            return True

    def give(self, size: int, tenant: str | None = None) -> None:
        """Stop holding `size` bytes of `tenant`'s."""
        with self._lock:
            self.held -= size
            if self.tenant_limit and tenant is not None:
                left = self.by_tenant.get(tenant, 0) - size
                if left:
                    self.by_tenant[tenant] = left
                else:
                    self.by_tenant.pop(tenant, None)

    def no_place_to_wait(self, tenant: str | None) -> bool:
        """Whether a call of `tenant` would have to wait for a read (all of `reads` taken,
        or all of its share) with no place left to wait: `max_waiting` calls wait already,
        or the tenant's share of those places."""
        mine = self._reads_of.get(tenant) if tenant is not None else None
        if not (self.reads.locked() or (mine is not None and mine.slots.locked())):
            return False
        if self.waiting >= self.max_waiting:
            return True
        return mine is not None and mine.waiting >= self.tenant_waiting

    @contextlib.asynccontextmanager
    async def read_slot(self, tenant: str | None) -> AsyncIterator[None]:
        """One of `reads` while the block runs, after one of `tenant`'s share of them (with
        a tenant limit); waits for them, counted in `waiting`."""
        mine = None
        if self.tenant_reads and tenant is not None:
            mine = self._reads_of.get(tenant)
            if mine is None:
                mine = self._reads_of[tenant] = _TenantReads(asyncio.Semaphore(self.tenant_reads))
            mine.users += 1
            mine.waiting += 1
        self.waiting += 1
        try:
            if mine is not None:
                await mine.slots.acquire()
            try:
                await self.reads.acquire()
            except BaseException:
                if mine is not None:
                    mine.slots.release()
                raise
        except BaseException:
            self._leave(tenant, mine)
            raise
        finally:
            self.waiting -= 1
            if mine is not None:
                mine.waiting -= 1
        try:
            yield
        finally:
            self.reads.release()
            if mine is not None:
                mine.slots.release()
            self._leave(tenant, mine)

    def _leave(self, tenant: str | None, mine: _TenantReads | None) -> None:
        """A call of `tenant` is done with its share of the reads (forgotten with its last)."""
        if tenant is not None and mine is not None:
            mine.users -= 1
            if not mine.users:
                del self._reads_of[tenant]


@dataclass(slots=True, eq=False)
class _TenantReads:
    """One tenant's share of the reads, while calls of it hold or wait for one."""

    slots: asyncio.Semaphore  # `tenant_reads` of them
    users: int = 0  # calls holding one or waiting for one
    waiting: int = 0  # of those, the ones waiting


async def read_request(
    held: HeldBytes,
    context: grpc.aio.ServicerContext,
    timeout_s: float,
    tenant: str | None,
    max_model_len: int,
    max_text_bytes: int | None = None,
) -> Sized:
    """The call's Generate request, read once one of `held.reads` (and of `tenant`'s share
    of them) is free, its bytes then held as `tenant`'s (the caller gives them back when the
    answer ends). Aborts the call instead with
    DEADLINE_EXCEEDED when the request has not arrived `timeout_s` after its read began (a
    stalled sender gives its read back), INVALID_ARGUMENT when it sent none or bytes that
    do not decode (which escaped as UNKNOWN "Unexpected DecodeError" before) or hold more
    elements, or strings longer, than a request may (`decode_request`, on a thread, naming
    the field: `max_model_len` bounds its resume tokens, `max_text_bytes` its text),
    RESOURCE_EXHAUSTED (`retry-after-ms`) when holding it would pass the bound, or when
    it would wait for a read with no place left to wait (`held.no_place_to_wait`)."""
    if held.no_place_to_wait(tenant):
        held.refused += 1
        await _busy(context, "as many requests waiting to be read")
    async with held.read_slot(tenant):
        try:
            async with asyncio.timeout(timeout_s):
                sized = await context.read()  # the bytes (`add_router_service`)
        except TimeoutError:
            sized = None
        if isinstance(sized, bytes):
            data, sized, refused = sized, None, None
            try:
                sized = await _decoded(data, max_model_len, max_text_bytes)
            except DecodeError:
                sized = CORRUPT
            except FieldError as exc:  # kept as text: its traceback holds the bytes
                refused = (str(exc), exc.field)
            # Aborted out of the handler, the bytes dropped first: raised in it, the abort's
            # context held this frame, and so the bytes, until a garbage collection (255 MiB
            # requests refused kept GBs: attacker review, s40).
            del data
            if refused is not None:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    refused[0],
                    trailing_metadata=(("epd-field", refused[1]),),
                )
    if context.done():  # the client's deadline passed: gRPC ended the call, nothing to say
        raise asyncio.CancelledError
    if sized is None:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request did not arrive within {timeout_s:.0f} s (request_timeout_s)",
        )
    if sized is CORRUPT:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "the request is not a GenerateRequest (corrupt)"
        )
    if not isinstance(sized, Sized):  # the client half-closed without a request
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no GenerateRequest was sent")
    if not held.take(sized.size, tenant=tenant):
        await _busy(context, "as many requests' bytes as it may")
    return sized


async def _decoded(data: bytes, max_model_len: int, max_text_bytes: int | None) -> Sized:
    """`decode_request` on a thread, awaited to its end even when the caller is cancelled:
    the read slot is held until then (a cancelled call's decode ran on beyond the slots,
    holding its bytes: one client cancelling 107 MiB requests grew a router 230 MB/s;
    ownfix review)."""
    decoding = asyncio.to_thread(decode_request, data, max_model_len, max_text_bytes)
    work = asyncio.ensure_future(decoding)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait((work,))
        if not work.cancelled():
            work.exception()  # retrieved: nobody waits for it any more
        raise
    finally:  # its error's traceback holds this frame: a cycle through the future, which
        del work, decoding, data  # held the bytes until a garbage collection


async def _busy(context: grpc.aio.ServicerContext, holds: str) -> None:
    """Abort the call with RESOURCE_EXHAUSTED: the router holds `holds`."""
    error = busy(holds)
    await context.abort(error.code, str(error), trailing_metadata=error.trailing_metadata)


def busy(holds: str) -> Refused:
    """RESOURCE_EXHAUSTED with a back-off hint: the router holds `holds`."""
    return Refused(
        f"the router holds {holds} (requests_in_flight_mb, of which a tenant may hold "
        "tenant_share)",
        RETRY_AFTER_S,
    )


class MediaHold:
    """One request's media in `held`: reserved from their headers before they are decoded
    (`reserve`, from the thread that reads them), then, once processed, the bytes of its
    patch codes (`holding`: the media as the router keeps them, for the encoder and for a
    prefill done again) until the answer ends. A compressed image is many times its bytes
    either way: a 4096x4096 JPEG of 270 KB decodes to 67 MB, and is 100 MB of codes (six
    bytes a pixel, an image being both frames of a temporal patch) under the released
    processor's max_pixels.

    The processing thread cannot be interrupted: a request that goes away while its media
    are processed gives its reservation back (`give_back`) while the thread may still be
    about to reserve. A reservation after `give_back` is refused (CANCELLED), so the thread
    holds nothing for a request nobody waits for (before, it held it for good: a router
    whose clients cancel at that moment filled its bound and refused everyone)."""

    def __init__(self, held: HeldBytes, holds: int, tenant: str | None = None) -> None:
        self.held = held
        self.holds = holds  # the bytes the request holds already (its body or message)
        self.tenant = tenant  # whose they are
        self.reserved = 0
        self._lock = threading.Lock()  # `reserve` (processing thread) vs `give_back` (loop)
        self._given_back = False

    def reserve(self, decoded: int) -> None:
        """Hold `decoded` bytes, or raise RouterError RESOURCE_EXHAUSTED (retry-after-ms)
        when the bound (or the tenant's share of it) does not allow them, or CANCELLED once
        the reservation was given back (the request went away)."""
        with self._lock:
            if self._given_back:
                raise RouterError(grpc.StatusCode.CANCELLED, "the request went away")
            if not self.held.take(decoded, self.holds, self.tenant):
                raise busy("as many requests' media as it may")
            self.reserved = decoded

    def give_back(self) -> None:
        """Give the reservation back (the request was refused, or went away, before it was
        processed); any later `reserve` is refused."""
        with self._lock:
            self._given_back = True
            self.held.give(self.reserved, self.tenant)
            self.reserved = 0

    @contextlib.contextmanager
    def holding(self, prompt: ProcessedPrompt) -> Iterator[None]:
        """Hold `prompt`'s codes instead of the reservation while the block runs. The
        difference is not refused: codes pass the reservation only for images made larger
        (`min_pixels`), which are small."""
        media = sum(codes.nbytes for codes in prompt.pixel_values)
        self.held.give(self.reserved - media, self.tenant)
        self.reserved = 0
        try:
            yield
        finally:
            self.held.give(media, self.tenant)


def add_router_service(servicer: Any, server: Any) -> None:
    """RouterService on `server`, as the generated `add_RouterServiceServicer_to_server`
    adds it but request-streaming: `servicer.Generate(requests, context)` reads its one
    request's bytes with `context.read()` when it chooses (`read_request`), decoded then
    off the event loop."""
    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=None,
            response_serializer=router_service_pb2.GenerateResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
