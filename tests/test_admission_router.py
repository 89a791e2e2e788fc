"""The router's admission control (`router.admission`) through a router with the fake
workers of `tests.test_router`: the safety net on a full prefill pool (the request goes back
in the queue), Status showing the queue, and the refusal's trailing `retry-after-ms`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest

from common.kv.allocator import blocks_for
from common.kv.block_pool import NoFreeBlocksError, PoolTooSmallError
from common.models.tiny import make_tiny_checkpoint
from common.processing.messages import messages_from_dicts
from common.roles import Role
from common.sampling import SamplingParams
from common.server.rpc import status_for
from epd.client import GenerateError, build_request
from epd.v1 import admin_service_pb2, registry_service_pb2, router_service_pb2_grpc
from router.admission import Need
from router.server import serve
from router.settings import RouterSettings
from router.workers import WorkerLoad
from tests.cluster import CLIENT_KEY, cluster_security
from tests.test_router import FIRST, TEXT, FakeDecode, FakePrefill
from tests.test_router import Cluster as RouterCluster


class ExhaustedPrefill(FakePrefill):
    """A fake prefill worker whose pool is full for its first `full` calls (as the worker
    says it: `status_for(NoFreeBlocksError)`), or, with `details`, refusing each call so."""

    def __init__(self, full: int = 0, details: str | None = None) -> None:
        super().__init__()
        self.full = full
        self.details = details or status_for(NoFreeBlocksError(2, 0))[1]

    async def Prefill(self, request: Any, context: Any) -> Any:
        if self.full:
            self.full -= 1
            self.requests.append(request)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.details)
        return await super().Prefill(request, context)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: Any) -> Any:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
async def router(ckpt: Any) -> Any:
    settings = RouterSettings(
        model=str(ckpt),
        port=0,
        http_port=-1,
        expected_model="fake-model",
        worker_timeout_s=60.0,
        max_queued_requests=1,
        security=cluster_security(),
    )
    c = RouterCluster(await serve(settings))
    yield c
    await c.close()


def give_capacity(c: RouterCluster, blocks: int) -> None:
    """As if every KV worker had heartbeated a pool of `blocks`."""
    for w in c.router.registry.workers():
        w.load = WorkerLoad(kv_blocks_free=blocks)


@pytest.mark.parametrize("legacy", [False, True])
async def test_a_full_prefill_pool_puts_the_request_back_in_the_queue(
    router: Any, legacy: bool
) -> None:
    # `legacy`: a prefill worker from before KV_POOL_FULL says only NoFreeBlocksError's text.
    pre = ExhaustedPrefill(full=2, details=str(NoFreeBlocksError(2, 0)) if legacy else None)
    for role, servicer in ((Role.PREFILL, pre), (Role.DECODE, FakeDecode())):
        await router.add(role, servicer)
    result = await router.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert result.token_ids == [FIRST, 101, 102, 103]  # the client saw no error
    assert len(pre.requests) == 3
    status = await router.admin.Status(admin_service_pb2.StatusRequest())
    assert (status.admitted_requests, status.requeued_requests, status.refused_requests) == (
        1,
        2,
        0,
    )
    assert status.queued_requests == 0


async def test_another_resource_exhausted_from_prefill_is_not_queued_again(router: Any) -> None:
    # Every RESOURCE_EXHAUSTED of a prefill worker was taken for a full pool: one that can
    # never succeed (a message past gRPC's size limit) was queued again for 60 s, then
    # reported as "no KV blocks free".
    too_big = "Received message larger than max (4194405 vs. 4194304)"
    pre = ExhaustedPrefill(full=5, details=too_big)
    for role, servicer in ((Role.PREFILL, pre), (Role.DECODE, FakeDecode())):
        await router.add(role, servicer)
    with pytest.raises(GenerateError) as err:
        await router.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in str(err.value) and len(pre.requests) == 1
    status = await router.admin.Status(admin_service_pb2.StatusRequest())
    assert status.requeued_requests == 0 and status.queued_requests == 0


async def test_status_shows_the_queue_and_the_overflow_gets_a_retry_after(router: Any) -> None:
    pre = FakePrefill()
    for role, servicer in ((Role.PREFILL, pre), (Role.DECODE, FakeDecode())):
        await router.add(role, servicer)
    prompt = router.router.orchestrator.processor.process(messages_from_dicts(TEXT))
    need = Need(len(prompt.prompt_token_ids), 4, 16)
    give_capacity(router, need.blocks(Role.DECODE))  # one request at a time
    pre.hang = True
    sampling = SamplingParams(max_tokens=4)
    first = asyncio.create_task(router.client.generate_text(TEXT, sampling))
    while not pre.requests:
        await asyncio.sleep(0.01)
    second = asyncio.create_task(router.client.generate_text(TEXT, sampling))
    status = await router.admin.Status(admin_service_pb2.StatusRequest())
    while status.queued_requests < 1:
        status = await router.admin.Status(admin_service_pb2.StatusRequest())
    reserved = {w.info.role: w.router_reserved_kv_blocks for w in status.workers}
    assert reserved == {
        registry_service_pb2.WORKER_ROLE_PREFILL: need.blocks(Role.PREFILL),
        registry_service_pb2.WORKER_ROLE_DECODE: need.blocks(Role.DECODE),
    }
    # The queue (max_queued_requests=1) is full: the third is refused, with a hint.
    stub = router_service_pb2_grpc.RouterServiceStub(router.channel)
    call = stub.Generate(
        build_request(TEXT, sampling), metadata=(("authorization", f"Bearer {CLIENT_KEY}"),)
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_requests=1" in err.value.details()
    assert ("retry-after-ms", "1000") in list(err.value.trailing_metadata() or ())
    first.cancel()  # frees its blocks: the second is admitted
    with contextlib.suppress(asyncio.CancelledError):
        await first
    while len(pre.requests) < 2:
        await asyncio.sleep(0.01)
    second.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await second
    status = await router.admin.Status(admin_service_pb2.StatusRequest())
    assert (status.queued_requests, status.queued_peak) == (0, 1)
    assert (status.admitted_requests, status.refused_requests) == (2, 1)
    assert status.queue_wait_max_s > 0


async def test_a_finished_answer_frees_its_reservation_before_the_client_takes_it(
    router: Any,
) -> None:
    # An HTTP client that stopped reading held its request's KV reservation past the
    # deadline, the decode worker long done (42% of a pool, 429s for everyone else).
    from common.server.auth import Caller

    for role, servicer in ((Role.PREFILL, FakePrefill()), (Role.DECODE, FakeDecode())):
        await router.add(role, servicer)
    give_capacity(router, 1000)
    admission = router.router.orchestrator.admission
    request = build_request(TEXT, SamplingParams(max_tokens=4))
    answer = router.router.servicer.generate(request, Caller("tenant-a"), None)
    chunks = []
    async for chunk in answer:  # read up to the last chunk, then stop reading
        chunks.append(chunk)
        if chunk.finish_reason:
            break
        assert admission._reserved and sum(admission._reserved.values()) > 0  # decoding
    assert [t for c in chunks for t in c.token_ids] == [FIRST, 101, 102, 103]
    assert not any(admission._reserved.values())  # given back before the last chunk
    assert all(w.placed == 0 for w in router.router.registry.workers())
    await answer.aclose()


class WholePoolDecode(FakeDecode):
    """A fake decode worker that refuses every call as one whose whole pool of `blocks`
    cannot hold it says it (`status_for(PoolTooSmallError)`)."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = blocks

    async def Decode(self, request: Any, context: Any) -> Any:
        error = PoolTooSmallError(self.blocks + 1, self.blocks, "sampling.max_tokens")
        await context.abort(*status_for(error))
        yield  # a stream


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
async def test_a_workers_own_never_fits_names_the_field_as_admission_would(
    router: Any, role: Role
) -> None:
    # A KV worker refuses a request its whole pool cannot hold itself until it has
    # heartbeated its pool (admission cannot check before): that refusal reached the client
    # naming no field, and "prompt asks for too many tokens" for a chat (ownfix review A).
    chat = [{"role": "user", "content": "hello " * 40}]
    prompt = router.router.orchestrator.processor.process(messages_from_dicts(chat))
    tokens = len(prompt.prompt_token_ids)
    blocks = blocks_for(tokens, 16) - 1 if role == Role.PREFILL else blocks_for(tokens + 1, 16)
    assert blocks > 0
    refused = status_for(PoolTooSmallError(blocks + 1, blocks, "prompt"))[1]
    prefill = ExhaustedPrefill(full=1, details=refused) if role == Role.PREFILL else FakePrefill()
    decode = WholePoolDecode(blocks) if role == Role.DECODE else FakeDecode()
    for worker_role, servicer in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        await router.add(worker_role, servicer)
    with pytest.raises(GenerateError) as err:
        await router.client.generate_text(chat, SamplingParams(max_tokens=16 * blocks))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    field = "messages" if role == Role.PREFILL else "sampling.max_tokens"
    assert err.value.field == field, str(err.value)
    assert f"the largest {role} worker has {blocks} in all" in str(err.value)
    assert "asks for too many tokens" not in str(err.value)


async def test_a_one_token_answer_is_served_while_no_decode_worker_is_up(router: Any) -> None:
    # Prefill's token is the whole answer, yet admission required a live decode worker
    # (UNAVAILABLE "no decode worker") and counted the request as placed on one.
    await router.add(Role.PREFILL, FakePrefill())
    result = await router.client.generate_text(TEXT, SamplingParams(max_tokens=1))
    assert result.token_ids == [FIRST] and result.finish_reason == "length"
    with pytest.raises(GenerateError) as err:
        await router.client.generate_text(TEXT, SamplingParams(max_tokens=2))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker" in str(err.value)
