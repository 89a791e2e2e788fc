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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.models.tiny import default_checkpoint
from common.rpc import (
    PROTOCOL_VERSION,
    Registrar,
    RunningServer,
    WorkerLifecycle,
    service_name,
    start_server,
)
from common.runner import LmRunner, ModelThread
from common.transfer import TransferAgent
from epd.v1 import prefill_service_pb2, prefill_service_pb2_grpc, registry_service_pb2
from prefill_worker.service import PrefillServicer
from prefill_worker.settings import PrefillSettings

logger = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]


@dataclass(slots=True, eq=False)
class WorkerServer(RunningServer):
    """A worker's running gRPC server plus what must stop with it (see the module docstring).

    `servicer` exposes the worker's counters; `registrar` is None without a router.
    """

    lifecycle: WorkerLifecycle = field(default_factory=WorkerLifecycle)  # drain / state
    servicer: Any = None  # the role servicer (counters, runner)
    registrar: Registrar | None = None  # router registration, when configured
    cleanup: list[Cleanup] = field(default_factory=list)  # run in order after gRPC stops

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stop gRPC (RPCs past `grace_s` are cancelled), then every cleanup step."""
        if self.stopped:
            return
        await RunningServer.stop(self, grace_s)
        for step in self.cleanup:
            try:
                await step()
            except Exception:
                logger.exception("prefill worker cleanup step failed")


def adopt(running: RunningServer, **extra: Any) -> WorkerServer:
    """A `WorkerServer` taking over a started `RunningServer`."""
    return WorkerServer(
        server=running.server,
        health=running.health,
        address=running.address,
        service_names=running.service_names,
        **extra,
    )


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
    registrar = None
    if settings.router_address:
        registrar = Registrar(
            settings.router_address,
            registry_service_pb2.WorkerInfo(
                role=registry_service_pb2.WORKER_ROLE_PREFILL,
                address=servicer.holder_address,
                model=runner.identity,
                kv_layout=runner.kv_layout,
                protocol_version=PROTOCOL_VERSION,
                capabilities=["nixl"],
                name=settings.name,
            ),
            servicer.load,
        )
        registrar.start()

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
