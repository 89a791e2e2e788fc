"""The encoder worker's gRPC server: EncoderService over the vision tower.

Lifecycle (see `common.server.role.RoleServer`): `serve(settings)` loads the vision tower,
starts gRPC (EncoderService + health), starts creating the NIXL agent and its registered
output arena (`output_pool_mb`) in the background, and registers with every router in
`routers` (`router_address` and `router_addresses`; role ENCODER, heartbeats carry cache
hits/lookups and in-flight requests). `server.drain()` refuses new Encode calls with
UNAVAILABLE "draining" and lets running ones finish; `server.stop()` then stops the
registrar, gRPC, the batcher, waits for outstanding output leases (up to `lease_ttl_s`) and
closes the agent. ReleaseEmbeddings stays available while draining.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.byte_lru import ENTRY_BYTES
from common.models.identity import load_identified
from common.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig
from common.models.qwen3_vl.vision import VisionTower
from common.models.qwen3_vl.weights import VISUAL_PREFIX
from common.processing.content_hash import processor_settings, settings_digest
from common.roles import EMBEDDING_DIGESTS, PATCH_CODES, PROTOCOL_VERSION
from common.server.leases import LeaseIdError, check_lease_id, refusal
from common.server.lifecycle import ServerLifecycle
from common.server.metrics import counter, gauge, requests_metrics, scrape_registry
from common.server.role import AddServicer, RoleServer, checkpoint_path
from common.server.rpc import logged, rpc_errors, service_name
from common.wire.convert import element_type, tensor_to_ref
from encoder_worker.cache import EncodedRows, EncoderCache
from encoder_worker.engine import EncoderEngine, ItemOutput
from encoder_worker.leases import OutputLeases
from encoder_worker.requests import ItemJob, parse_request
from encoder_worker.settings import EncoderSettings
from epd.v1 import (
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    registry_service_pb2,
    tensor_pb2,
)

logger = logging.getLogger(__name__)

ENCODER_SERVICE = service_name(encoder_service_pb2, "EncoderService")


@dataclass(frozen=True, slots=True)
class EncoderCounters:
    """What the encoder worker did since start (tests, logs, the pool manager)."""

    active: int  # Encode calls in flight
    leases: int  # NIXL outputs not yet freed
    leases_released: int  # outputs their reader released
    leases_expired: int  # outputs the reaper freed
    leases_unpooled: int  # outputs that did not fit the output arena (own registered buffer)
    cache_hits: int  # items answered from the encoder cache
    cache_lookups: int  # items looked up in the cache
    cache_entries: int  # items the cache holds
    cache_bytes: int  # bytes the cache holds
    cache_evictions: int  # items evicted from the cache
    forward_calls: int  # vision-tower forwards
    batches: int  # batches the engine ran
    units_encoded: int  # items or partitions encoded
    units_abandoned: int  # queued ones dropped: every request waiting for them went away
    rows_encoded: int  # patch rows encoded


class EncoderServicer(encoder_service_pb2_grpc.EncoderServiceServicer):
    """EncodeRequest → validated jobs → engine (cache + batched tower) → TensorRefs."""

    def __init__(
        self,
        engine: EncoderEngine,
        leases: OutputLeases | None,
        lifecycle: ServerLifecycle,
        vision: VisionConfig,
        settings: EncoderSettings,
        fingerprint: bytes,
    ) -> None:
        self.engine = engine
        self.leases = leases  # None: NIXL off, every output inline
        self.lifecycle = lifecycle
        self.vision = vision
        self.settings = settings
        # The checkpoint's processor settings, which every content hash it computes covers.
        self.fingerprint = fingerprint

    @rpc_errors
    async def Encode(
        self, request: encoder_service_pb2.EncodeRequest, context: Any
    ) -> encoder_service_pb2.EncodeResponse:
        """Rows for every requested item (or its requested partitions), in request order."""
        async with self.lifecycle.track():
            started = time.perf_counter()
            jobs = parse_request(
                request,
                self.vision,
                self.fingerprint,
                exact_partitions=self.settings.exact_partitions,
            )
            lease_ids = _lease_ids(request.lease_key, len(jobs))
            parsed = time.perf_counter()
            outputs = await self.engine.encode(jobs, request.request_id)
            leased: list[str] = []  # leases made for this answer, freed if it is not sent
            try:
                items = [
                    await self._encoded(job, out, lease_id, leased, request.request_id)
                    for job, out, lease_id in zip(jobs, outputs, lease_ids, strict=True)
                ]
            except BaseException as exc:
                if self.leases is not None:
                    self.leases.release(leased)
                if isinstance(exc, LeaseIdError):  # released by the caller (it gave up), or live
                    raise refusal(exc, "lease_key") from None
                raise
            logger.debug(
                "request %s: %d items, %d from cache; parse and verify %.1f ms, encode and "
                "answer %.1f ms",
                logged(request.request_id),
                len(items),
                sum(out.cache_hit for out in outputs),
                (parsed - started) * 1000,
                (time.perf_counter() - parsed) * 1000,
            )
            return encoder_service_pb2.EncodeResponse(items=items)

    @rpc_errors
    async def ReleaseEmbeddings(
        self, request: encoder_service_pb2.ReleaseEmbeddingsRequest, context: Any
    ) -> encoder_service_pb2.ReleaseEmbeddingsResponse:
        """Free output leases early; unknown ids are ignored."""
        released = self.leases.release(request.lease_ids) if self.leases is not None else 0
        return encoder_service_pb2.ReleaseEmbeddingsResponse(released=released)

    async def _encoded(
        self,
        job: ItemJob,
        out: ItemOutput,
        lease_id: str | None,
        leased: list[str],
        request_id: str = "",
    ) -> encoder_service_pb2.EncodedItem:
        refs = await self._refs(out.rows, lease_id, leased, request_id)
        return encoder_service_pb2.EncodedItem(
            content_hash=job.content_hash,
            rows=refs[0],
            deepstack=refs[1:],
            partition_indices=job.partition_indices,
            cache_hit=out.cache_hit,
        )

    async def _refs(
        self, rows: EncodedRows, lease_id: str | None, leased: list[str], request_id: str = ""
    ) -> list[tensor_pb2.TensorRef]:
        """The rows inline, or by handle under a lease (`lease_id`, None: a random id; the
        lease's id is appended to `leased`; `request_id`: what its expiry's log line says)."""
        tensors = [rows.rows, *rows.deepstack]
        if rows.nbytes > self.settings.inline_limit_bytes and self.leases is not None:
            agent = await self.leases.agent()
            if agent is not None:
                handles = self.leases.export(agent, tensors, lease_id, request_id)
                leased.append(handles[0].lease_id)
                return [
                    tensor_pb2.TensorRef(
                        dtype=element_type(t.dtype), shape=list(t.shape), handle=handle
                    )
                    for t, handle in zip(tensors, handles, strict=True)
                ]
        return [tensor_to_ref(t) for t in tensors]

    @property
    def counters(self) -> EncoderCounters:
        """A snapshot of the counters (see EncoderCounters)."""
        engine, cache, leases = self.engine, self.engine.cache, self.leases
        return EncoderCounters(
            active=self.lifecycle.active,
            leases=len(leases) if leases is not None else 0,
            leases_released=leases.released if leases is not None else 0,
            leases_expired=leases.expired if leases is not None else 0,
            leases_unpooled=leases.unpooled if leases is not None else 0,
            cache_hits=cache.hits,
            cache_lookups=cache.lookups,
            cache_entries=len(cache),
            cache_bytes=cache.bytes_used,
            cache_evictions=cache.evictions,
            forward_calls=engine.forward_calls,
            batches=engine.batches,
            units_encoded=engine.units_encoded,
            units_abandoned=engine.units_abandoned,
            rows_encoded=engine.rows_encoded,
        )

    def load(self) -> registry_service_pb2.WorkerLoad:
        """Load for the router's heartbeat."""
        cache = self.engine.cache
        return registry_service_pb2.WorkerLoad(
            active_requests=self.lifecycle.active,
            cache_hits=cache.hits,
            cache_lookups=cache.lookups,
            draining=self.lifecycle.draining,
        )


def encoder_metrics(servicer: EncoderServicer) -> list[Any]:
    """The encoder's metrics at scrape time (docs/metrics.md): requests, its cache, its
    output leases."""
    c, waiting = servicer.counters, servicer.engine.waiting_requests()
    return [
        *requests_metrics(max(c.active - waiting, 0), waiting),
        counter(
            "epd:encoder_cache_queries", "Items looked up in the encoder cache.", c.cache_lookups
        ),
        counter("epd:encoder_cache_hits", "Items answered from the encoder cache.", c.cache_hits),
        gauge("epd:encoder_cache_bytes", "Bytes held by the encoder cache.", c.cache_bytes),
        counter("epd:encoder_cache_evictions", "Encoder cache entries evicted.", c.cache_evictions),
        counter(
            "epd:encoder_units_encoded", "Items or partitions the tower encoded.", c.units_encoded
        ),
        counter(
            "epd:encoder_units_abandoned",
            "Queued items or partitions not encoded: every request waiting for them went away.",
            c.units_abandoned,
        ),
        gauge("epd:encoder_output_leases", "Outputs held for readers over NIXL now.", c.leases),
        counter(
            "epd:encoder_output_leases_expired",
            "Output leases the reaper freed: no reader released them.",
            c.leases_expired,
        ),
    ]


def load_tower(path: Path, settings: EncoderSettings) -> tuple[Qwen3VLConfig, VisionTower, str]:
    """Read the config and only the vision tower's weights, and the checkpoint's identity
    (blocking; `common.models.identity.load_identified`)."""
    config = Qwen3VLConfig.from_file(path)
    tensors, identity = load_identified(
        path, config, dtype=settings.torch_dtype, prefix=(VISUAL_PREFIX,), device=settings.device
    )
    tower = VisionTower.from_weights(config, tensors, packed_weights=settings.packed_weights)
    return config, tower, identity


async def serve(
    settings: EncoderSettings, *, extra_servicers: Sequence[AddServicer] = ()
) -> RoleServer[EncoderServicer]:
    """Load the vision tower and start serving; returns once listening (the caller stops it).

    `extra_servicers` are served on the same port. Raises SettingsError on unusable settings
    and the loader's errors on a bad checkpoint.
    """
    settings.check()
    path = await asyncio.to_thread(checkpoint_path, settings.model)
    config, tower, identity = await asyncio.to_thread(load_tower, path, settings)
    pixel_settings = await asyncio.to_thread(processor_settings, path, config)
    fingerprint = pixel_settings.fingerprint()
    engine = EncoderEngine(
        tower,
        EncoderCache(settings.cache_bytes, ENTRY_BYTES),
        batch_window_s=settings.batch_window_ms / 1000.0,
        max_batch_rows=settings.max_batch_rows,
        settings=pixel_settings,
    )
    leases = None
    if settings.nixl:
        leases = OutputLeases(
            settings.lease_ttl_s, pool_bytes=settings.output_pool_mb << 20, device=settings.device
        )
    lifecycle = ServerLifecycle()

    async def close() -> None:
        await engine.close()
        if leases is not None:
            await leases.close(wait_s=settings.lease_ttl_s)

    servicer = EncoderServicer(engine, leases, lifecycle, config.vision, settings, fingerprint)
    if leases is not None:
        # The NIXL agent, before anything is served: making it, UCX hooks and tests the calls
        # that move the program break (brk, sbrk); made beside requests (it was, after the
        # server started), it moved the break under glibc's heap on another thread, which
        # aborted the process ("break adjusted to free malloc space": chaos review, s37;
        # `scripts/ucx_hooks_race.py`).
        leases.start()
        try:
            await leases.agent()
        except BaseException:  # cancelled: `RoleServer.start` would have run `close`
            await close()
            raise
    server: RoleServer[EncoderServicer] = await RoleServer.start(
        settings,
        servicer,
        encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server,
        [ENCODER_SERVICE],
        lifecycle=lifecycle,
        extra_servicers=extra_servicers,
        leases=leases,
        cleanup=[close],
        metrics=scrape_registry(lambda: encoder_metrics(servicer)),
    )
    info = registry_service_pb2.WorkerInfo(
        role=registry_service_pb2.WORKER_ROLE_ENCODER,
        address=settings.reachable_address(server.address),
        model=identity,
        protocol_version=PROTOCOL_VERSION,
        capabilities=[PATCH_CODES, EMBEDDING_DIGESTS, *(["nixl"] if settings.nixl else [])],
        name=settings.name,
        processor=settings_digest(pixel_settings),
        dtype=settings.dtype,
    )
    server.register(settings.routers, info, server.servicer.load, settings.router_dns)
    logger.info("encoder worker serving %s on %s (model %s)", path, server.address, identity)
    return server


def _lease_ids(lease_key: str, items: int) -> list[str | None]:
    """Per item of a request, the id its output lease is to have: "<lease_key>-<k>", or
    None (the encoder picks) without a key. RpcStatusError INVALID_ARGUMENT naming
    `lease_key` when it is malformed (1 to 48 characters of [A-Za-z0-9_-])."""
    if not lease_key:
        return [None] * items
    try:
        check_lease_id(lease_key)
        if len(lease_key) > 48:
            raise LeaseIdError(lease_key, "longer than 48 characters")
    except LeaseIdError as exc:
        raise refusal(exc, "lease_key") from None
    return [f"{lease_key}-{k}" for k in range(items)]
