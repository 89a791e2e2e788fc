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

Lifecycle: channels open on first use and live until `forget(address)` (a worker left),
`reopen(address)` (a worker restarted there: the next call dials afresh instead of waiting
out the old channel's reconnect back-off) or `close()`, which first waits for the releases
in flight, then closes every channel.
Every channel presents the `credentials` given (the cluster bearer and, with TLS, this
process's certificate: `common.server.auth.service_credentials`).
Touched only from the owner's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import grpc

from common.server.credentials import NO_CREDENTIALS, ChannelCredentials
from common.server.rpc import DEFAULT_MAX_MESSAGE_MB, channel
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


class PeerClient:
    """Channels to peers by address plus background lease releases (module docstring)."""

    def __init__(
        self,
        *,
        release_timeout_s: float = 5.0,
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        credentials: ChannelCredentials = NO_CREDENTIALS,
    ) -> None:
        self.release_timeout_s = release_timeout_s  # deadline of each release call
        self.max_message_mb = max_message_mb  # message limit of every channel
        self.credentials = credentials  # what every channel presents
        self._channels: dict[str, grpc.aio.Channel] = {}  # peer address -> channel
        self._tasks: set[asyncio.Task[None]] = set()  # releases in flight

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to `address`, opened on first use."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(
                address, max_message_mb=self.max_message_mb, credentials=self.credentials
            )
        return ch

    async def forget(self, address: str) -> None:
        """Close the channel to `address`, if open (the peer went away)."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    def reopen(self, address: str) -> None:
        """Drop the channel to `address` now (the next `get` opens a new one) and close the
        old one in the background: the process behind it restarted, calls on it are dead."""
        ch = self._channels.pop(address, None)
        if ch is not None:
            self._spawn(ch.close(), "closing the old channel", address)

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
        (the worker makes none if the release comes first). A worker from before caller
        lease ids leases under its own id, which is then left to its TTL as before."""
        request.lease_id = uuid.uuid4().hex
        stub = prefill_service_pb2_grpc.PrefillServiceStub(self.get(address))
        call = stub.Prefill(request, timeout=timeout)
        lease_id = request.lease_id
        response: prefill_service_pb2.PrefillResponse = await self._unless_lost(
            call, lambda: self.release_kv(address, lease_id)
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
            call, lambda: self._release_embeddings_on(address, ids)
        )
        return response

    @staticmethod
    async def _unless_lost(call: Awaitable[T], release: Callable[[], None]) -> T:
        """`await call`; `release()` first when it ends without its answer, so that what
        the worker made for that answer is freed (the caller stopped waiting: a worker's
        own refusals come before it makes anything)."""
        try:
            return await call
        except asyncio.CancelledError:
            release()
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _ANSWER_LOST:
                release()
            raise

    def renew_kv(self, address: str, lease_id: str) -> None:
        """`PrefillService.RenewKv(lease_id)` on the prefill worker at `address`, in the
        background (the reader is still waiting to pull)."""
        if lease_id and address:
            stub = prefill_service_pb2_grpc.PrefillServiceStub(self.get(address))
            call = stub.RenewKv(
                prefill_service_pb2.RenewKvRequest(lease_id=lease_id),
                timeout=self.release_timeout_s,
            )
            self._spawn(call, f"RenewKv({lease_id})", address)

    async def confirm_release_kv(
        self, address: str, lease_id: str, mismatched_blocks: Sequence[int] = ()
    ) -> bool:
        """`ReleaseKv(lease_id)` on the prefill worker at `address`, awaited: True when the
        holder says the lease was live until now (bytes read under it are valid); False when
        it was not, or the holder cannot be reached. `mismatched_blocks` names the handle's
        blocks whose pulled bytes failed their digest (the holder re-checks them)."""
        stub = prefill_service_pb2_grpc.PrefillServiceStub(self.get(address))
        request = prefill_service_pb2.ReleaseKvRequest(
            lease_id=lease_id, mismatched_blocks=mismatched_blocks
        )
        try:
            response = await stub.ReleaseKv(request, timeout=self.release_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning("ReleaseKv(%s) on %s failed: %s", lease_id, address, exc.code().name)
            return False
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
        """Wait for the releases in flight, then close every channel."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
