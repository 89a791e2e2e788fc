"""Background release of leases a request no longer needs.

A request that ends early (cancelled, failed, out of time) may hold a KV lease on a prefill
worker or embedding leases on an encoder that nobody else will release. The router frees
them in background tasks, so a cancelled request still frees them, each call bounded by
its own deadline. Releasing twice is harmless: workers ignore unknown lease ids.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

import grpc

from epd.v1 import (
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
)
from router.channels import Channels

logger = logging.getLogger(__name__)


class Releases:
    """Fire-and-forget lease releases; `close` waits for those still running."""

    def __init__(self, channels: Channels, timeout_s: float) -> None:
        self.channels = channels
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def kv(self, lease_id: str, address: str) -> None:
        """`PrefillService.ReleaseKv(lease_id)` on the prefill worker at `address`."""
        if lease_id and address:
            stub = prefill_service_pb2_grpc.PrefillServiceStub(self.channels.get(address))
            request = prefill_service_pb2.ReleaseKvRequest(lease_id=lease_id)
            self._spawn(stub.ReleaseKv(request, timeout=self.timeout_s), "KV", address)

    def embeddings(self, leases: dict[str, str]) -> None:
        """`EncoderService.ReleaseEmbeddings` for each lease id -> encoder address."""
        by_encoder: dict[str, list[str]] = {}
        for lease_id, address in leases.items():
            by_encoder.setdefault(address, []).append(lease_id)
        for address, lease_ids in by_encoder.items():
            stub = encoder_service_pb2_grpc.EncoderServiceStub(self.channels.get(address))
            request = encoder_service_pb2.ReleaseEmbeddingsRequest(lease_ids=lease_ids)
            call = stub.ReleaseEmbeddings(request, timeout=self.timeout_s)
            self._spawn(call, "embedding", address)

    def _spawn(self, call: Awaitable[object], kind: str, address: str) -> None:
        async def run() -> None:
            try:
                await call
                logger.debug("released %s lease(s) on %s", kind, address)
            except grpc.aio.AioRpcError as exc:
                logger.warning("%s lease release on %s failed: %s", kind, address, exc.code().name)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait for the releases still running."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
