"""Start a prefill worker: load the model, register the KV buffer with NIXL, serve gRPC,
register with the router, reap expired leases.

Lifecycle: `serve(settings)` returns a started `WorkerServer` (SERVING, registered when a
router address is given). `await server.stop(grace_s)` (or `server.lifecycle.drain()`, which
ends in `stop`) stops gRPC, then the registrar and the reaper, releases every lease, stops
the model thread and closes the NIXL agent — in that order, so no block or registration
outlives the worker's users.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.models.tiny import default_checkpoint
from common.server.kv_worker import Cleanup, WorkerServer, adopt, register_kv_worker
from common.server.rpc import WorkerLifecycle, service_name, start_server
from common.transfer.agent import TransferAgent
from epd.v1 import prefill_service_pb2, prefill_service_pb2_grpc, registry_service_pb2
from prefill_worker.service import PrefillServicer
from prefill_worker.settings import PrefillSettings

logger = logging.getLogger(__name__)


async def serve(
    settings: PrefillSettings,
    *,
    extra_servicers: Sequence[Callable[[Any], None]] = (),
) -> WorkerServer:
    """Start a prefill worker as `settings` say and return it serving (see module docstring).

    `extra_servicers` are more `add_*Servicer_to_server` callables to serve on the same port.
    """
    path = settings.model or str(default_checkpoint("tiny"))
    runner = await asyncio.to_thread(
        LmRunner.from_pretrained,
        path,
        dtype=settings.torch_dtype,
        device=settings.device,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        prefill_chunk=settings.prefill_chunk,
    )
    model = ModelThread("epd-prefill")
    agent = TransferAgent("prefill")
    lifecycle = WorkerLifecycle()
    try:
        servicer = PrefillServicer(
            runner,
            model,
            agent,
            lifecycle,
            lease_ttl_s=settings.lease_ttl_s,
            embedding_pull_timeout_s=settings.embedding_pull_timeout_s,
        )
        running = await start_server(
            [
                lambda s: prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server(
                    servicer, s
                ),
                *extra_servicers,
            ],
            host=settings.host,
            port=settings.port,
            service_names=[service_name(prefill_service_pb2, "PrefillService")],
        )
    except BaseException:
        model.close()
        agent.close()
        raise
    servicer.holder_address = settings.advertise_address or running.address
    reaper = asyncio.create_task(servicer.reap_leases(), name="epd-lease-reaper")
    registrar = register_kv_worker(
        settings.router_address,
        role=registry_service_pb2.WORKER_ROLE_PREFILL,
        address=servicer.holder_address,
        runner=runner,
        name=settings.name,
        load=servicer.load,
    )

    async def stop_reaper() -> None:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper

    async def close() -> None:
        await servicer.release_all_leases()
        await servicer.close()
        await asyncio.to_thread(model.close)
        agent.close()

    steps: list[Cleanup] = [stop_reaper, close]
    if registrar is not None:
        steps.insert(0, registrar.stop)
    server = adopt(
        running, lifecycle=lifecycle, servicer=servicer, registrar=registrar, cleanup=steps
    )
    lifecycle.attach(server)
    logger.info(
        "prefill worker %s serving %s (%s, block %d x %d)",
        servicer.holder_address,
        runner.identity,
        settings.dtype,
        settings.block_size,
        settings.num_blocks,
    )
    return server
