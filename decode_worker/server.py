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

from common.server.kv_worker import KvWorkerParts, kv_worker_info
from common.server.role import AddServicer, RoleServer
from common.server.rpc import service_name
from decode_worker.service import DecodeServicer
from decode_worker.settings import DecodeSettings
from epd.v1 import decode_service_pb2, decode_service_pb2_grpc, registry_service_pb2

logger = logging.getLogger(__name__)

DECODE_SERVICE = service_name(decode_service_pb2, "DecodeService")


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
    )
    servicer.batcher.start()
    address = settings.reachable_address(server.address)
    info = kv_worker_info(registry_service_pb2.WORKER_ROLE_DECODE, address, runner, settings.name)
    server.register(settings.router_address, info, servicer.load)
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
