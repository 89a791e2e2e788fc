"""A prefill whose RPC is cancelled before the model thread reaches it does not run: a
caller that sends prompts and cancels them cannot queue a prefill worker's compute. The
packer's rule alone, with the cases of a prompt cancelled while or after it is computed,
is in tests/test_prefill_packing.py; here it is checked through a real prefill worker,
after the model thread's own rule for calls whose caller went away."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from common.engine import Engine
from common.models.model_thread import ModelThread
from common.server.role import RoleServer
from common.server.rpc import channel
from epd.v1 import prefill_service_pb2, prefill_service_pb2_grpc
from prefill_worker.server import prefill_metrics
from prefill_worker.server import serve as serve_prefill
from prefill_worker.settings import PrefillSettings
from tests.cluster import cluster_credentials, cluster_security
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    ckpt,
    engine,
    eventually,
    make_handoff,
    prefill_request,
    user,
)

__all__ = ["ckpt", "engine"]  # module fixtures shared with test_kv_handoff


async def test_a_model_thread_call_whose_caller_went_away_still_runs_and_hands_on() -> None:
    """The model thread's own rule (decode's imports, event subscriptions): a call cancelled
    while queued still runs, and `on_orphan` receives its result."""
    thread = ModelThread("test-orphan")
    gate = threading.Event()
    ran: list[str] = []
    orphans: list[None] = []
    try:
        busy = asyncio.ensure_future(thread.call(gate.wait, 10))
        kept = asyncio.ensure_future(thread.call(ran.append, "kept", on_orphan=orphans.append))
        await asyncio.sleep(0.05)
        kept.cancel()
        await asyncio.gather(kept, return_exceptions=True)
        gate.set()
        await busy
        await eventually(lambda: orphans)
        assert ran == ["kept"] and orphans == [None]
    finally:
        gate.set()
        thread.close()


pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(ckpt: Path) -> AsyncIterator[RoleServer[Any]]:
    server = await serve_prefill(
        PrefillSettings(
            model=str(ckpt), block_size=BLOCK, num_blocks=48, security=cluster_security()
        )
    )
    yield server
    await server.stop(0)


def metrics(worker: RoleServer[Any]) -> list[Any]:
    return prefill_metrics(worker.servicer)


async def test_a_prefill_cancelled_while_queued_is_not_computed(
    worker: RoleServer[Any], engine: Engine
) -> None:
    servicer = worker.servicer
    pool = servicer.runner.allocator.pool
    tokens, params = make_handoff(engine, user("A question nobody waits for the answer to."))
    gate = threading.Event()
    busy = asyncio.ensure_future(servicer.model.call(gate.wait, 30))  # a long forward
    async with channel(worker.address, credentials=cluster_credentials()) as ch:
        stub = prefill_service_pb2_grpc.PrefillServiceStub(ch)
        try:
            call = stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
            queue = servicer.model._executor._work_queue
            await eventually(lambda: queue.qsize() == 1)  # queued behind the long forward
            call.cancel()
            await eventually(lambda: servicer.packer.dropped == 1)
        finally:
            gate.set()
            await busy
        assert servicer.requests == 0 and pool.num_used_blocks == 0
        assert ("epd:prefills_dropped", 1) in [
            (m.name, m.samples[0].value) for m in metrics(worker)
        ]
        assert servicer.runner.allocator.cached_hashes() == []  # its prompt was never computed
        reply = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
        assert reply.computed_tokens == len(tokens) and servicer.requests == 1


async def test_a_lease_released_while_its_prompt_computes_is_never_made(
    worker: RoleServer[Any], engine: Engine
) -> None:
    """The router releases the lease id it chose when its Prefill call ends without the
    answer; a release that overtakes the answer bars the id: the prefill answers CANCELLED
    and its blocks go back to the pool instead of pinning them until the lease's TTL."""
    servicer = worker.servicer
    pool = servicer.runner.allocator.pool
    tokens, params = make_handoff(engine, user("Computed while its caller gave up."))
    request = prefill_request(tokens, params, GREEDY)
    request.lease_id = "router-chose-this"
    held = (len(servicer.leases), pool.num_used_blocks)  # an earlier test's lease is live
    gate = threading.Event()
    busy = asyncio.ensure_future(servicer.model.call(gate.wait, 30))
    async with channel(worker.address, credentials=cluster_credentials()) as ch:
        stub = prefill_service_pb2_grpc.PrefillServiceStub(ch)
        try:
            call = stub.Prefill(request, timeout=30)
            queue = servicer.model._executor._work_queue
            await eventually(lambda: queue.qsize() == 1)  # its compute waits for the thread
            release = prefill_service_pb2.ReleaseKvRequest(lease_id="router-chose-this")
            assert not (await stub.ReleaseKv(release, timeout=10)).released  # not made yet
        finally:
            gate.set()
            await busy
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.CANCELLED
        assert "lease_id" in (refused.value.details() or "")
        assert (len(servicer.leases), pool.num_used_blocks) == held
        # Released first, asked for after: refused before any work.
        requests = servicer.requests
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await stub.Prefill(request, timeout=30)
        assert again.value.code() == grpc.StatusCode.CANCELLED and servicer.requests == requests


async def test_a_lease_id_live_already_or_malformed_is_refused(
    worker: RoleServer[Any], engine: Engine
) -> None:
    servicer = worker.servicer
    pool = servicer.runner.allocator.pool
    held = (len(servicer.leases), pool.num_used_blocks)
    tokens, params = make_handoff(engine, user("Two callers, one lease id."))
    request = prefill_request(tokens, params, GREEDY)
    request.lease_id = "one-id"
    async with channel(worker.address, credentials=cluster_credentials()) as ch:
        stub = prefill_service_pb2_grpc.PrefillServiceStub(ch)
        reply = await stub.Prefill(request, timeout=30)
        assert reply.kv.lease_id == "one-id"
        for lease_id, code in (
            ("one-id", grpc.StatusCode.ALREADY_EXISTS),
            ("no spaces", grpc.StatusCode.INVALID_ARGUMENT),
        ):
            request.lease_id = lease_id
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Prefill(request, timeout=30)
            assert refused.value.code() == code and "lease_id" in (refused.value.details() or "")
        release = prefill_service_pb2.ReleaseKvRequest(lease_id="one-id")
        assert (await stub.ReleaseKv(release, timeout=10)).released
    await servicer.settle_releases()
    assert (len(servicer.leases), pool.num_used_blocks) == held
