"""Start a prefill worker: load the model, register the KV buffer with NIXL, serve gRPC,
register with every router given, reap expired leases.

Lifecycle: `serve(settings)` returns a started `RoleServer` (SERVING, registered with
every router in `settings.routers`, the lease reaper running). `await server.stop(grace_s)` (or
`server.drain(timeout_s)`, which ends in `stop`) stops the registrar, then gRPC, then the
servicer (the reaper, every lease's blocks, pending embedding releases), the model thread
and the NIXL agent — in that order, so no block or registration outlives the worker's users.
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
from epd.v1 import prefill_service_pb2, prefill_service_pb2_grpc, registry_service_pb2
from prefill_worker.service import PrefillServicer
from prefill_worker.settings import PrefillSettings

logger = logging.getLogger(__name__)

PREFILL_SERVICE = service_name(prefill_service_pb2, "PrefillService")


def prefill_metrics(servicer: PrefillServicer) -> list[Any]:
    """The prefill worker's metrics at scrape time (docs/metrics.md): requests, the pool,
    the KV leases it holds for decode workers."""
    c, waiting = servicer.counters, servicer.packer.waiting
    return [
        *requests_metrics(max(c.active - waiting, 0), waiting),
        *kv_pool_metrics(servicer.runner.allocator.pool, servicer.runner.allocator.block_size),
        counter("epd:prefill_requests", "Prefill calls answered with a KV handle.", c.requests),
        counter(
            "epd:prefills_dropped",
            "Prefills not computed: their call was cancelled before the model thread took them.",
            servicer.packer.dropped,
        ),
        counter(
            "epd:prefill_packs",
            "Model-thread turns that computed prompts: one alone, or a pack of several.",
            servicer.packer.packs,
        ),
        counter(
            "epd:prefills_packed",
            "Prompts computed together with others in one pack.",
            servicer.packer.packed,
        ),
        gauge("epd:kv_leases", "KV leases held for decode workers now.", c.leases),
        counter("epd:kv_leases_expired", "KV leases the reaper freed.", c.leases_expired),
        counter("epd:kv_leases_released", "KV leases released by ReleaseKv.", c.leases_released),
        counter(
            "epd:kv_digest_failures",
            "Cached blocks found changed since computed (recomputed).",
            c.digest_mismatches,
        ),
        counter(
            "epd:embedding_digest_failures",
            "Embeddings READ from encoders whose bytes were not those lent (encoded again).",
            servicer.embeddings.digest_failures,
        ),
    ]


async def serve(
    settings: PrefillSettings, *, extra_servicers: Sequence[AddServicer] = ()
) -> RoleServer[PrefillServicer]:
    """Start a prefill worker as `settings` say and return it serving (see module docstring).

    `extra_servicers` are more `add_*Servicer_to_server` callables to serve on the same port.
    """
    parts = await KvWorkerParts.make(settings, "prefill", prefill_chunk=settings.prefill_chunk)
    runner = parts.runner
    servicer = PrefillServicer(
        parts,
        lease_ttl_s=settings.lease_ttl_s,
        lease_ttl_per_lease_s=settings.lease_ttl_per_lease_s,
        embedding_pull_timeout_s=settings.embedding_pull_timeout_s,
        pack_tokens=settings.pack_tokens,
    )
    server: RoleServer[PrefillServicer] = await RoleServer.start(
        settings,
        servicer,
        prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server,
        [PREFILL_SERVICE],
        lifecycle=parts.lifecycle,
        extra_servicers=extra_servicers,
        leases=servicer.leases,
        cleanup=[parts.closer(servicer.close)],
        metrics=scrape_registry(lambda: prefill_metrics(servicer)),
    )
    servicer.holder_address = settings.reachable_address(server.address)
    servicer.reap_leases()
    role = registry_service_pb2.WORKER_ROLE_PREFILL
    info = kv_worker_info(role, servicer.holder_address, runner, settings.name)
    server.register(settings.routers, info, servicer.load, settings.router_dns)
    logger.info(
        "prefill worker %s serving %s (%s, block %d x %d)",
        servicer.holder_address,
        runner.identity,
        settings.dtype,
        settings.block_size,
        settings.num_blocks,
    )
    return server
