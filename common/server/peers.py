"""Calls from one epd process to the workers it talks to: one channel per address, and
fire-and-forget lease releases over them.

Shared by the router (its calls to every worker, its Prefill and Encode calls under lease
ids of its own, and the releases of leases a request left behind) and the KV workers
(prefill releasing encoder embeddings it pulled, decode releasing the prefill KV lease it
pulled). A release runs as a background task bounded by its own deadline, so a cancelled
request still frees what it held; a failed release is logged, not raised (the holder's
reaper frees the lease at its TTL). Releasing twice is harmless: holders ignore unknown
lease ids (they remember one for a lease TTL, so that a call still answering under it makes
no lease).

Lifecycle: channels open on first use and live until `forget(address)` (a worker left, or
restarted there: the next call dials afresh instead of waiting out the old channel's
reconnect back-off), `keep_only(addresses)` (those of the workers still registered: a
release sent after a worker left must not leave a channel redialling a dead address) or
`close()`, which first waits for the releases in flight, then closes every channel.
A call whose channel is closed under it (its worker was dropped: silent, or frozen; a frozen
peer also fails its calls by keepalive, `common.server.transport.KEEPALIVE_S`) ends with UNAVAILABLE
(`channel_cut`), which callers try elsewhere; never with a CancelledError its caller did not
ask for, which ended a request with no answer to its client.
Every channel presents the `credentials` given (the cluster bearer and, with TLS, this
process's certificate: `common.server.auth.service_credentials`).
Touched only from the owner's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
    Sequence,
)
from typing import TypeVar

import grpc

from common.server.credentials import NO_CREDENTIALS, ChannelCredentials
from common.server.rpc import channel
from common.server.transport import DEFAULT_MAX_MESSAGE_MB, KEEPALIVE_S, RECONNECT_MAX_S
from epd.v1 import (
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Call failures after which the worker may hold a lease its caller never learnt of: the
# caller stopped waiting (a worker's own refusals are answered before any lease is made).
_ANSWER_LOST = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED})


def caller_cancelled() -> bool:
    """Whether the task running now is being cancelled: a CancelledError out of a call is
    then its own; else the call's channel was closed under it (`channel_cut`)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def channel_cut(address: str) -> grpc.aio.AioRpcError:
    """The error of a call whose channel was closed under it (its peer left): UNAVAILABLE,
    which callers try on another peer."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"the channel to {address} was closed: the worker left",
    )


async def uncut(call: Awaitable[T], address: str) -> T:
    """`await call`, a channel closed under it raising `channel_cut(address)`."""
    try:
        return await call
    except asyncio.CancelledError:
        if caller_cancelled():
            raise
        raise channel_cut(address) from None


async def stream_uncut(call: AsyncIterable[T], address: str) -> AsyncIterator[T]:
    """The messages of a streaming `call`, a channel closed under it raising
    `channel_cut(address)`."""
    try:
        async for message in call:
            yield message
    except asyncio.CancelledError:
        if caller_cancelled():
            raise
        raise channel_cut(address) from None


class PeerClient:
    """Channels to peers by address plus background lease releases (module docstring)."""

    def __init__(
        self,
        *,
        release_timeout_s: float = 5.0,
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        credentials: ChannelCredentials = NO_CREDENTIALS,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.release_timeout_s = release_timeout_s  # deadline of each release call
        self.max_message_mb = max_message_mb  # message limit of every channel
        self.credentials = credentials  # what every channel presents
        self.keepalive_s = keepalive_s  # a peer silent this long after a ping fails its calls
        self._channels: dict[str, grpc.aio.Channel] = {}  # peer address -> channel
        self._tasks: set[asyncio.Task[None]] = set()  # releases in flight

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to `address`, opened on first use."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(
                address,
                max_message_mb=self.max_message_mb,
                credentials=self.credentials,
                keepalive_s=self.keepalive_s,
            )
        return ch

    def forget(self, address: str) -> None:
        """Drop the channel to `address` now (the worker left or restarted there: the next
        `get` dials afresh) and close it in the background: its calls in flight end with
        UNAVAILABLE (`uncut`), and are tried on another worker."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            self._spawn(ch.close(), "closing the channel", address)

    def keep_only(self, addresses: Collection[str]) -> None:
        """`forget` every channel to an address not in `addresses`."""
        for address in [a for a in self._channels if a not in addresses]:
            self.forget(address)

    def release_kv(self, address: str, lease_id: str) -> None:
        """`PrefillService.ReleaseKv(lease_id)` on the prefill worker at `address`, in the
        background. Nothing is sent without both."""
        if lease_id and address:
            stub = prefill_service_pb2_grpc.PrefillServiceStub(self.get(address))
            request = prefill_service_pb2.ReleaseKvRequest(lease_id=lease_id)
            call = stub.ReleaseKv(request, timeout=self.release_timeout_s)
            self._spawn(call, f"ReleaseKv({lease_id})", address)

    async def prefill(
        self, address: str, request: prefill_service_pb2.PrefillRequest, timeout: float | None
    ) -> prefill_service_pb2.PrefillResponse:
        """`PrefillService.Prefill(request)` on the worker at `address`, under a lease id of
        this caller's (a fresh one set on `request`): if the call ends without its answer
        (cancelled, or past its deadline), the lease the worker may have made meanwhile is
        released in the background instead of pinning the prompt's blocks until its TTL
        (the worker makes none if the release comes first)."""
        request.lease_id = uuid.uuid4().hex
        stub = prefill_service_pb2_grpc.PrefillServiceStub(self.get(address))
        call = stub.Prefill(request, timeout=timeout)
        lease_id = request.lease_id
        response: prefill_service_pb2.PrefillResponse = await self._unless_lost(
            call, address, lambda: self.release_kv(address, lease_id)
        )
        return response

    async def encode(
        self, address: str, request: encoder_service_pb2.EncodeRequest, timeout: float | None
    ) -> encoder_service_pb2.EncodeResponse:
        """`EncoderService.Encode(request)` on the encoder at `address`, under a lease key of
        this caller's (a fresh one set on `request`): as `prefill`, the output leases the
        encoder may have made for an answer that never arrives are released in the
        background (item k's is "<key>-<k>")."""
        request.lease_key = uuid.uuid4().hex
        stub = encoder_service_pb2_grpc.EncoderServiceStub(self.get(address))
        call = stub.Encode(request, timeout=timeout)
        ids = [f"{request.lease_key}-{k}" for k in range(len(request.items))]
        response: encoder_service_pb2.EncodeResponse = await self._unless_lost(
            call, address, lambda: self._release_embeddings_on(address, ids)
        )
        return response

    @staticmethod
    async def _unless_lost(call: Awaitable[T], address: str, release: Callable[[], None]) -> T:
        """`await uncut(call, address)`; `release()` first when it ends without its answer,
        so that what the worker made for that answer is freed (the caller stopped waiting,
        or the channel closed: a worker's own refusals come before it makes anything)."""
        try:
            return await uncut(call, address)
        except asyncio.CancelledError:
            release()
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _ANSWER_LOST or exc.code() == grpc.StatusCode.UNAVAILABLE:
                release()
            raise

    async def renew_kv(self, address: str, lease_id: str) -> float | None:
        """`PrefillService.RenewKv(lease_id)` on the prefill worker at `address` (a reader
        still waiting to pull): seconds the lease has left, None when the holder says it is
        gone. Raises grpc.aio.AioRpcError when the holder does not answer."""
        stub = prefill_service_pb2_grpc.PrefillServiceStub(self.get(address))
        request = prefill_service_pb2.RenewKvRequest(lease_id=lease_id)
        response = await uncut(stub.RenewKv(request, timeout=self.release_timeout_s), address)
        return response.lease_ttl_ms / 1000 if response.renewed else None

    async def confirm_release_kv(
        self, address: str, lease_id: str, mismatched_blocks: Sequence[int] = ()
    ) -> bool | None:
        """`ReleaseKv(lease_id)` on the prefill worker at `address`, awaited: True when the
        holder says the lease was live until now (bytes read under it are valid); False when
        it says it was not; None when the holder cannot be reached. `mismatched_blocks` names
        the handle's blocks whose pulled bytes failed their digest (the holder re-checks
        them)."""
        stub = prefill_service_pb2_grpc.PrefillServiceStub(self.get(address))
        request = prefill_service_pb2.ReleaseKvRequest(
            lease_id=lease_id, mismatched_blocks=mismatched_blocks
        )
        try:
            try:
                response = await stub.ReleaseKv(request, timeout=self.release_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # Once more, waiting out the channel's reconnect back-off (a holder back at
                # its address after a restart: failing at once, the pulled KV was refused and
                # prefilled again, every request of the next second), but not for the whole
                # call's time (a holder gone for good: the KV refused 5 s late).
                wait = min(self.release_timeout_s, 2 * RECONNECT_MAX_S)
                response = await stub.ReleaseKv(request, timeout=wait, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            logger.warning("ReleaseKv(%s) on %s failed: %s", lease_id, address, exc.code().name)
            return None
        return bool(response.released)

    def release_embeddings(self, holders: Mapping[str, str]) -> None:
        """`EncoderService.ReleaseEmbeddings` in the background, one call per encoder, for
        each lease id -> holder (encoder) address in `holders`."""
        by_encoder: dict[str, list[str]] = {}
        for lease_id, address in holders.items():
            by_encoder.setdefault(address, []).append(lease_id)
        for address, lease_ids in by_encoder.items():
            self._release_embeddings_on(address, lease_ids)

    def _release_embeddings_on(self, address: str, lease_ids: Sequence[str]) -> None:
        stub = encoder_service_pb2_grpc.EncoderServiceStub(self.get(address))
        request = encoder_service_pb2.ReleaseEmbeddingsRequest(lease_ids=lease_ids)
        call = stub.ReleaseEmbeddings(request, timeout=self.release_timeout_s)
        self._spawn(call, f"ReleaseEmbeddings({len(lease_ids)} leases)", address)

    def _spawn(self, call: Awaitable[object], what: str, address: str) -> None:
        async def run() -> None:
            try:
                await call
                logger.debug("%s on %s done", what, address)
            except grpc.aio.AioRpcError as exc:
                logger.warning("%s on %s failed: %s", what, address, exc.code().name)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait for the releases in flight, those started meanwhile too (a request's
        cleanup running late: races review L2, s45), then close every channel."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
