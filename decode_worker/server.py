"""Start a decode worker: load the model and tokenizer, register the KV buffer with NIXL,
start the decode loop, serve gRPC, register with the router.

Lifecycle: `serve(settings)` returns a started `WorkerServer` (SERVING, registered when a
router address is given). `await server.stop(grace_s)` (or `server.lifecycle.drain()`)
stops gRPC, then the registrar, then the decode loop (releasing every running sequence's
blocks) and pending lease releases, the model thread, and the NIXL agent — in that order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.models.tiny import default_checkpoint
from common.server.kv_worker import Cleanup, WorkerServer, adopt, register_kv_worker
from common.server.rpc import WorkerLifecycle, service_name, start_server
from common.transfer.agent import TransferAgent
from decode_worker.service import DecodeServicer
from decode_worker.settings import DecodeSettings
from epd.v1 import decode_service_pb2, decode_service_pb2_grpc, registry_service_pb2

logger = logging.getLogger(__name__)


async def serve(
    settings: DecodeSettings,
    *,
    extra_servicers: Sequence[Callable[[Any], None]] = (),
) -> WorkerServer:
    """Start a decode worker as `settings` say and return it serving (see module docstring).

    `extra_servicers` are more `add_*Servicer_to_server` callables to serve on the same port.
    """
    path = Path(settings.model or default_checkpoint("tiny"))
    runner = await asyncio.to_thread(
        LmRunner.from_pretrained,
        path,
        dtype=settings.torch_dtype,
        device=settings.device,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
    )
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = ModelThread("epd-decode")
    agent = TransferAgent("decode")
    lifecycle = WorkerLifecycle()
    try:
        servicer = DecodeServicer(
            runner,
            model,
            agent,
            tokenizer,
            lifecycle,
            max_batch=settings.max_batch,
            pull_timeout_s=settings.pull_timeout_s,
            release_timeout_s=settings.release_timeout_s,
        )
        running = await start_server(
            [
                lambda s: decode_service_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, s),
                *extra_servicers,
            ],
            host=settings.host,
            port=settings.port,
            service_names=[service_name(decode_service_pb2, "DecodeService")],
        )
    except BaseException:
        model.close()
        agent.close()
        raise
    servicer.batcher.start()
    address = settings.advertise_address or running.address
    registrar = register_kv_worker(
        settings.router_address,
        role=registry_service_pb2.WORKER_ROLE_DECODE,
        address=address,
        runner=runner,
        name=settings.name,
        load=servicer.load,
    )

    async def close() -> None:
        await servicer.close()
        await asyncio.to_thread(model.close)
        agent.close()

    steps: list[Cleanup] = [close]
    if registrar is not None:
        steps.insert(0, registrar.stop)
    server = adopt(
        running, lifecycle=lifecycle, servicer=servicer, registrar=registrar, cleanup=steps
    )
    lifecycle.attach(server)
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
