"""Start a decode worker: load the model (no tokenizer: the router owns the text), register
the KV buffer with NIXL, start the decode loop, serve gRPC, register with the router.

Lifecycle: `serve(settings)` returns a started `RoleServer` (SERVING, registered when a
router address is given). `await server.stop(grace_s)` (or `server.drain(timeout_s)`)
stops the registrar, then gRPC, then the decode loop (releasing every running sequence's
blocks) and pending lease releases, the model thread, and the NIXL agent — in that order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from common.server.kv_worker import KvWorkerParts, kv_worker_info
from common.server.metrics import (
    counter,
    gauge,
    kv_pool_metrics,
    requests_metrics,
    scrape_registry,
)
from common.server.role import AddServicer, RoleServer
from common.server.rpc import service_name
from decode_worker.service import DecodeServicer
from decode_worker.settings import DecodeSettings
from epd.v1 import decode_service_pb2, decode_service_pb2_grpc, registry_service_pb2

logger = logging.getLogger(__name__)

DECODE_SERVICE = service_name(decode_service_pb2, "DecodeService")


def decode_metrics(servicer: DecodeServicer) -> list[Any]:
    """The decode worker's metrics at scrape time (docs/metrics.md): streams in the batch
    and before it (validating, waiting for blocks, pulling), the pool, `DecodeCounters`, the
    batched steps (`Batch`: read off the model thread; each a plain number)."""
    c, running = servicer.counters, servicer.batcher.running
    batch = servicer.batcher.batch
    return [
        *requests_metrics(running, max(servicer.active - running, 0)),
        *kv_pool_metrics(servicer.runner.allocator.pool, servicer.runner.allocator.block_size),
        counter("epd:decode_requests", "Decode streams admitted.", c.requests),
        counter(
            "epd:kv_blocks_pulled",
            "Prompt KV blocks READ from prefill and used (lease confirmed).",
            c.blocks_pulled,
        ),
        counter("epd:kv_blocks_reused", "Full prompt blocks found here.", c.blocks_reused),
        counter("epd:kv_bytes_pulled", "Bytes READ from prefill, used or not.", c.bytes_pulled),
        counter("epd:kv_pull_seconds", "Wall time in KV READs, timed out or not.", c.pull_seconds),
        counter("epd:kv_hash_mismatches", "KV handles refused: hashes differ.", c.hash_mismatches),
        counter(
            "epd:kv_digest_failures",
            "Pulled blocks failing their digest; cached ones found changed (pulled again).",
            c.digest_mismatches + servicer.runner.allocator.digest_mismatches,
        ),
        counter("epd:kv_leases_lost", "Pulls discarded: lease not live.", c.leases_lost),
        counter("epd:kv_block_waits", "Requests that waited for free blocks.", c.block_waits),
        gauge(
            "epd:kv_blocks_quarantined",
            "Blocks kept from the pool while a READ that timed out may still write them.",
            sum(list(servicer.importer.quarantined.values())),  # a snapshot (metrics thread)
        ),
        counter("epd:decode_steps", "Batched decode forwards run.", batch.steps),
        counter("epd:decode_step_sequences", "Sequences decoded, over all steps.", batch.decoded),
        counter("epd:decode_step_seconds", "Wall time of the decode steps.", batch.step_seconds),
        counter(
            "epd:decode_step_cpu_seconds",
            "CPU time of the model thread in the decode forwards.",
            batch.step_cpu_seconds,
        ),
    ]


async def serve(
    settings: DecodeSettings, *, extra_servicers: Sequence[AddServicer] = ()
) -> RoleServer[DecodeServicer]:
    """Start a decode worker as `settings` say and return it serving (see module docstring).

    `extra_servicers` are more `add_*Servicer_to_server` callables to serve on the same port.
    """
    parts = await KvWorkerParts.make(settings, "decode")
    runner = parts.runner
    servicer = DecodeServicer(
        parts,
        max_batch=settings.max_batch,
        stream_interval=settings.stream_interval,
        pull_timeout_s=settings.pull_timeout_s,
        release_timeout_s=settings.release_timeout_s,
        renew_leases=settings.renew_leases,
    )
    server: RoleServer[DecodeServicer] = await RoleServer.start(
        settings,
        servicer,
        decode_service_pb2_grpc.add_DecodeServiceServicer_to_server,
        [DECODE_SERVICE],
        lifecycle=parts.lifecycle,
        extra_servicers=extra_servicers,
        cleanup=[parts.closer(servicer.close)],
        metrics=scrape_registry(lambda: decode_metrics(servicer)),
    )
    servicer.batcher.start()
    address = settings.reachable_address(server.address)
    info = kv_worker_info(registry_service_pb2.WORKER_ROLE_DECODE, address, runner, settings.name)
    server.register(settings.routers, info, servicer.load, settings.router_dns)
    logger.info(
        "decode worker %s serving %s (%s, block %d x %d, batch %d)",
        address,
        runner.identity,
        settings.dtype,
        settings.block_size,
        settings.num_blocks,
        settings.max_batch,
    )
    return server
