"""What the KV workers (prefill and decode) share around their servicers: what a worker is
made of before it serves (`KvWorkerParts`: the cluster key, the credentials it presents, its
runner, model thread, NIXL agent and lifecycle), the registration they send the router, and
their heartbeat load.

Their running server is a `common.server.role.RoleServer`; their calls to peers go through
`common.server.peers.PeerClient`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from common.kv.events import MAX_QUEUED_EVENTS, KvEventHub, NumberedKvEvent, Subscription
from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.roles import PROTOCOL_VERSION, SIGNED_KV
from common.server.auth import service_credentials
from common.server.credentials import ChannelCredentials
from common.server.lifecycle import ServerLifecycle
from common.server.role import Cleanup, checkpoint_path
from common.server.rpc import RpcStatusError, logged
from common.settings.base import KvWorkerSettings
from common.transfer.agent import TransferAgent
from common.wire.kv import layout_to_proto
from epd.v1 import registry_service_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KvWorkerParts:
    """A KV worker's parts, made before its servicer: see `make`; `closer` stops them."""

    key: bytes | None  # the cluster key (signs or checks KV handles); None: insecure
    credentials: ChannelCredentials  # what this worker presents to its peers
    runner: LmRunner  # model + KV cache
    model: ModelThread  # the one thread every runner call runs on
    agent: TransferAgent  # this worker's NIXL agent
    lifecycle: ServerLifecycle  # serving / draining

    @classmethod
    async def make(cls, settings: KvWorkerSettings, role: str, **runner: Any) -> KvWorkerParts:
        """Check `settings` (SettingsError naming the field: a missing cluster token among
        them), read the key, load the runner (`runner` goes to `load_runner`)."""
        settings.check()
        key = settings.security.cluster_key(f"{role} worker")
        loaded = await asyncio.to_thread(load_runner, settings, **runner)
        return cls(
            key,
            service_credentials(settings.security),
            loaded,
            ModelThread(f"epd-{role}"),
            TransferAgent(role),
            ServerLifecycle(),
        )

    def closer(self, close_servicer: Cleanup) -> Cleanup:
        """The server's cleanup step: the servicer, then the model thread, then the agent."""

        async def close() -> None:
            await close_servicer()
            await asyncio.to_thread(self.model.close)
            self.agent.close()

        return close


def load_runner(settings: KvWorkerSettings, **extra: Any) -> LmRunner:
    """The checkpoint's language model and a KV cache as `settings` say (blocking).

    `extra` goes to `LmRunner.from_pretrained` (e.g. prefill's `prefill_chunk`)."""
    return LmRunner.from_pretrained(
        checkpoint_path(settings.model),
        dtype=settings.torch_dtype,
        device=settings.device,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        packed_weights=settings.packed_weights,
        **extra,
    )


def kv_worker_info(
    role: registry_service_pb2.WorkerRole, address: str, runner: LmRunner, name: str
) -> registry_service_pb2.WorkerInfo:
    """What a KV worker registers: its address, model identity and KV layout."""
    return registry_service_pb2.WorkerInfo(
        role=role,
        address=address,
        model=runner.identity,
        kv_layout=layout_to_proto(runner.kv_layout),
        protocol_version=PROTOCOL_VERSION,
        capabilities=["nixl", SIGNED_KV],
        name=name,
        dtype=runner.kv_layout.dtype_name,
    )


def kv_load(
    runner: LmRunner, active: int, lifecycle: ServerLifecycle
) -> registry_service_pb2.WorkerLoad:
    """Heartbeat load of a KV worker: `active` RPCs, KV blocks, prefix-cache hits/lookups."""
    pool = runner.allocator.pool
    return registry_service_pb2.WorkerLoad(
        active_requests=active,
        kv_blocks_used=pool.num_used_blocks,
        kv_blocks_free=pool.num_free_blocks,
        cache_hits=pool.hits,
        cache_lookups=pool.lookups,
        draining=lifecycle.draining,
    )


async def stream_kv_events(
    hub: KvEventHub, model: ModelThread, subscriber: str
) -> AsyncIterator[list[NumberedKvEvent]]:
    """A worker's KV event stream for one subscriber: first `[snapshot]` (taken on the
    model thread, see `KvEventHub.subscribe`), then each batch of the live events queued
    since the last one, in sequence order. Ends only with RESOURCE_EXHAUSTED when the
    subscriber fell `MAX_QUEUED_EVENTS` behind (events were dropped: it subscribes again);
    closing the generator (the RPC is cancelled) unsubscribes."""
    sub = Subscription(asyncio.get_running_loop())
    snapshot = await model.call(hub.subscribe, sub, on_orphan=lambda _: hub.unsubscribe(sub))
    subscriber = logged(subscriber)  # a peer's name, for logs only
    logger.info("KV event subscriber %s joined", subscriber)
    try:
        yield [snapshot]
        while True:
            if sub.overflowed:
                raise RpcStatusError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"KV event subscriber {subscriber} fell {MAX_QUEUED_EVENTS} events "
                    "behind; subscribe again",
                )
            events = [await sub.queue.get()]
            while not sub.queue.empty():
                events.append(sub.queue.get_nowait())
            yield events
    finally:
        hub.unsubscribe(sub)
