"""The router's admission control (`router.admission`) against a real `Registry`: workers
are registered and heartbeat their KV capacity in-process, so the ledger, the FIFO queue,
its bounds, cancellation and the refusals are checked without any network or model; then
through a router with the fake workers of `tests.test_router` (the safety net on a full
prefill pool, Status, the refusal's trailing `retry-after-ms`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.models.tiny import make_tiny_checkpoint
from common.processing.messages import messages_from_dicts
from common.roles import Role
from common.sampling import SamplingParams
from common.wire.roles import role_to_proto
from epd.client import build_request
from epd.v1 import (
    admin_service_pb2,
    kv_pb2,
    registry_service_pb2,
    router_service_pb2_grpc,
    tensor_pb2,
)
from router.admission import Admission, Need, Ticket
from router.calls import Refused, RouterError
from router.registry import Registry
from router.server import serve
from router.settings import RouterSettings
from router.workers import WorkerLoad, WorkerRecord
from tests.cluster import CLIENT_KEY, cluster_security
from tests.test_router import FIRST, TEXT, FakeDecode, FakePrefill
from tests.test_router import Cluster as RouterCluster

MODEL = "fake-model"
BLOCK = 4
FAR = 1e9  # a deadline that never comes


def info(role: Role, address: str) -> registry_service_pb2.WorkerInfo:
    msg = registry_service_pb2.WorkerInfo(
        role=role_to_proto(role), address=address, model=MODEL, protocol_version="epd.v1"
    )
    msg.kv_layout.CopyFrom(
        kv_pb2.KvLayout(
            model=MODEL,
            dtype=tensor_pb2.ELEMENT_TYPE_FLOAT32,
            block_size=BLOCK,
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
            layout="block-major",
            block_bytes=16384,
        )
    )
    return msg


def deployment(
    prefill: tuple[int | None, ...] = (8,), decode: tuple[int | None, ...] = (8,)
) -> Registry:
    """A registry with one worker per capacity given (None: no heartbeat yet)."""
    registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0)
    for role, caps in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        for i, cap in enumerate(caps):
            record = registry.register(info(role, f"{role}-{i}:1"))
            if cap is not None:
                registry.heartbeat(record.worker_id, WorkerLoad(kv_blocks_free=cap))
    return registry


def pick(registry: Registry) -> Any:
    def choose(role: Role, exclude: frozenset[str]) -> WorkerRecord:
        return registry.pick(role, exclude=exclude)

    return choose


def make(registry: Registry, **kw: Any) -> Admission:
    kw.setdefault("max_queued", 100)
    kw.setdefault("max_wait_s", 30.0)
    kw.setdefault("poll_s", 0.02)
    return Admission(registry, **kw)


async def admit(adm: Admission, prompt: int, max_tokens: int = 1, deadline: float = FAR) -> Ticket:
    return await adm.admit(prompt, max_tokens, time.monotonic() + deadline, pick(adm.registry))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_need_is_what_the_workers_allocate() -> None:
    need = Need(prompt_tokens=9, max_tokens=4, block_size=4)
    assert need.blocks(Role.PREFILL) == 3  # 9 prompt slots
    assert need.blocks(Role.DECODE) == 3  # 9 + 3 slots: the last token is never written
    assert Need(9, 5, 4).blocks(Role.DECODE) == 4


async def test_a_request_that_fits_is_admitted_at_once_and_reserved_on_both_roles() -> None:
    adm = make(deployment())
    ticket = await admit(adm, prompt=9, max_tokens=8)
    assert adm.reserved("prefill-0:1") == 3 and adm.reserved("decode-0:1") == 4
    assert adm.stats().admitted == 1 and adm.stats().queued == 0
    adm.release(ticket, Role.PREFILL)
    assert adm.reserved("prefill-0:1") == 0 and adm.reserved("decode-0:1") == 4
    adm.release(ticket)
    adm.release(ticket)  # idempotent
    assert adm.reserved("decode-0:1") == 0


async def test_waiters_are_admitted_first_in_first_out_as_blocks_are_released() -> None:
    adm = make(deployment(prefill=(8,), decode=(8,)))
    first = await admit(adm, prompt=32)  # the whole pool
    order: list[int] = []

    async def wait(i: int, prompt: int) -> Ticket:
        ticket = await admit(adm, prompt)
        order.append(i)
        return ticket

    # The small ones would fit before the big one; FIFO keeps them behind it.
    tasks = [asyncio.create_task(wait(i, p)) for i, p in enumerate([32, 4, 4])]
    await settle()
    assert adm.stats().queued == 3 and order == []
    adm.release(first)
    await settle()
    assert order == [0]
    adm.release(await tasks[0])
    for t in tasks[1:]:
        await t
    assert order == [0, 1, 2]
    assert adm.stats().peak == 3 and adm.stats().admitted == 4


async def test_the_queue_is_bounded_by_count_and_the_refusal_names_the_limit() -> None:
    adm = make(deployment(), max_queued=2)
    held = await admit(adm, prompt=32)
    waiting = [asyncio.create_task(admit(adm, prompt=4)) for _ in range(2)]
    await settle()
    with pytest.raises(Refused) as err:
        await admit(adm, prompt=4)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queued_requests=2" in str(err.value) and "retry after" in str(err.value)
    assert err.value.trailing_metadata == (("retry-after-ms", "1000"),)  # no history yet
    assert adm.refused["queue_full"] == 1 and adm.stats().queued == 2
    adm.release(held)
    for t in waiting:
        adm.release(await t)


async def test_one_tenant_fills_at_most_its_share_of_the_queue() -> None:
    """`tenant_share`: with 4 places and a share of a half, tenant a waits in two of them;
    its third is refused naming the share while tenant b still queues; a requeued request
    counts while it waits again."""
    adm = make(deployment(), max_queued=4, tenant_share=0.5)
    held = await admit(adm, prompt=32)  # the pool is full: the rest wait

    def of(tenant: str) -> Any:
        return adm.admit(4, 1, time.monotonic() + FAR, pick(adm.registry), tenant)

    a_waiting = [asyncio.create_task(of("a")) for _ in range(2)]
    await settle()
    with pytest.raises(Refused) as err:
        await of("a")
    assert "tenant_share" in str(err.value) and err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    b_waiting = asyncio.create_task(of("b"))
    await settle()
    assert not b_waiting.done() and adm.stats().queued == 3 and adm.refused["queue_full"] == 1
    adm.release(held)
    tickets = [await t for t in (*a_waiting, b_waiting)]
    assert [t.tenant for t in tickets] == ["a", "a", "b"] and adm.tenants.waiting == 0
    unshared = make(deployment(), max_queued=4)  # share 1: any tenant may fill the queue
    assert unshared.tenants.queue_places == 0
    for ticket in tickets:
        adm.release(ticket)


async def test_no_queue_refuses_at_once_what_does_not_fit() -> None:
    adm = make(deployment(), max_queued=0)
    held = await admit(adm, prompt=32)
    with pytest.raises(Refused, match="max_queued_requests=0"):
        await admit(adm, prompt=4)
    adm.release(held)
    adm.release(await admit(adm, prompt=4))


async def test_the_wait_is_bounded_and_the_refused_request_holds_nothing() -> None:
    adm = make(deployment(), max_wait_s=0.1)
    held = await admit(adm, prompt=32)
    started = time.monotonic()
    with pytest.raises(Refused) as err:
        await admit(adm, prompt=4)
    assert 0.1 <= time.monotonic() - started < 1.0
    assert "max_queue_wait_s=0.1" in str(err.value)
    assert err.value.retry_after_s == pytest.approx(0.1)  # capped by the wait limit
    assert adm.stats().queued == 0 and adm.stats().refused == 1
    adm.release(held)
    assert adm.reserved("prefill-0:1") == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_frees_its_place() -> None:
    adm = make(deployment(), max_queued=1)
    held = await admit(adm, prompt=32)
    waiter = asyncio.create_task(admit(adm, prompt=4))
    await settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.stats().queued == 0 and adm.cancelled == 1
    nxt = asyncio.create_task(admit(adm, prompt=4))  # the freed place
    await settle()
    adm.release(held)
    ticket = await nxt
    assert adm.reserved("prefill-0:1") == 1  # only the admitted one's block
    adm.release(ticket)


async def test_a_cancelled_head_wakes_the_next_one() -> None:
    adm = make(deployment(), poll_s=10.0)  # only the kick can wake it in time
    held = await admit(adm, prompt=16)  # half the pool
    head = asyncio.create_task(admit(adm, prompt=32))  # needs all of it
    nxt = asyncio.create_task(admit(adm, prompt=16))  # fits now, waits behind the head
    await settle()
    head.cancel()
    ticket = await asyncio.wait_for(nxt, 1.0)
    adm.release(ticket)
    adm.release(held)


async def test_a_deadline_while_queued_is_deadline_exceeded_and_holds_nothing() -> None:
    adm = make(deployment())
    held = await admit(adm, prompt=32)
    with pytest.raises(RouterError) as err:
        await admit(adm, prompt=4, deadline=0.05)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "queued" in str(err.value)
    assert adm.stats().queued == 0 and adm.expired == 1 and adm.stats().refused == 0
    adm.release(held)
    assert adm.reserved("prefill-0:1") == 0


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "role", "need"),
    [(40, 1, "prefill", 10), (20, 30, "decode", 13)],
)
async def test_a_request_that_can_never_fit_is_refused_at_once(
    prompt: int, max_tokens: int, role: str, need: int
) -> None:
    adm = make(deployment(prefill=(8, 9), decode=(12,)))
    started = time.monotonic()
    with pytest.raises(RouterError) as err:
        await admit(adm, prompt=prompt, max_tokens=max_tokens)
    assert time.monotonic() - started < 0.05
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    largest = 9 if role == "prefill" else 12
    assert f"needs {need} KV blocks of 4 tokens on a {role} worker" in str(err.value)
    assert f"the largest {role} worker has {largest} in all" in str(err.value)
    assert not isinstance(err.value, Refused)  # no back-off: it cannot help
    assert adm.refused["never_fits"] == 1 and adm.stats().queued == 0


async def test_no_worker_of_a_role_is_unavailable() -> None:
    adm = make(deployment(decode=()))
    with pytest.raises(RouterError) as err:
        await admit(adm, prompt=4)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker" in str(err.value)


async def test_workers_without_a_heartbeat_are_not_accounted() -> None:
    adm = make(deployment(prefill=(None,), decode=(None,)))
    tickets = [await admit(adm, prompt=400) for _ in range(3)]  # nothing to hold them to
    assert adm.reserved("prefill-0:1") == 300
    for t in tickets:
        adm.release(t)


async def test_choose_sees_only_workers_with_room() -> None:
    adm = make(deployment(prefill=(4, 8), decode=(8,)))
    seen: list[frozenset[str]] = []

    def choose(role: Role, exclude: frozenset[str]) -> WorkerRecord:
        seen.append(exclude)
        return adm.registry.pick(role, exclude=exclude)

    ticket = await adm.admit(24, 1, time.monotonic() + FAR, choose)  # 6 blocks
    assert seen == [frozenset({"prefill-0:1"}), frozenset()]
    assert ticket.workers[Role.PREFILL].address == "prefill-1:1"
    adm.move(ticket, Role.PREFILL, adm.registry.workers(Role.PREFILL)[0])  # a retry
    assert adm.reserved("prefill-0:1") == 6 and adm.reserved("prefill-1:1") == 0
    adm.release(ticket)


async def test_a_requeued_request_goes_back_to_the_head_after_a_back_off() -> None:
    adm = make(deployment(), retry_backoff_s=0.05)
    ticket = await admit(adm, prompt=32)
    behind = asyncio.create_task(admit(adm, prompt=32))
    await settle()
    started = time.monotonic()
    # The prefill worker refused it for a full pool: it goes back ahead of `behind`.
    await adm.requeue(ticket, pick(adm.registry))
    assert time.monotonic() - started >= 0.05
    assert ticket.workers and adm.requeued == 1 and not behind.done()
    adm.release(ticket)
    adm.release(await behind)
    assert adm.reserved("prefill-0:1") == 0


async def test_the_back_off_hint_follows_the_recent_waits() -> None:
    adm = make(deployment(), max_wait_s=5.0)
    assert adm.retry_after_s() == 1.0  # nothing known yet
    held = await admit(adm, prompt=32)
    waiter = asyncio.create_task(admit(adm, prompt=32))
    await asyncio.sleep(0.3)
    adm.release(held)
    adm.release(await waiter)
    assert 0.3 <= adm.retry_after_s() < 0.6  # the one request that queued
    stats = adm.stats()
    assert stats.wait_max_s == pytest.approx(adm.retry_after_s())
    assert stats.wait_p50_s == pytest.approx(stats.wait_max_s / 2)  # of 0 and the wait


@settings(max_examples=40, deadline=None)
@given(
    needs=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    releases=st.randoms(use_true_random=False),
)
def test_fifo_and_the_ledger_hold_for_any_needs(needs: list[int], releases: Any) -> None:
    """Whatever the sizes and the order admitted requests finish in: requests are admitted
    in arrival order, reservations never exceed a worker's capacity, and nothing is left
    reserved at the end."""

    async def scenario() -> None:
        adm = make(deployment(prefill=(10, 7), decode=(12,)), poll_s=0.01)
        order: list[int] = []
        live: list[Ticket] = []

        async def one(i: int, prompt: int) -> None:
            try:
                live.append(await admit(adm, prompt=prompt))
            except RouterError:
                return
            order.append(i)

        tasks = [asyncio.create_task(one(i, 4 * n)) for i, n in enumerate(needs)]
        while not all(t.done() for t in tasks) or live:
            await settle()
            for w in adm.registry.workers():
                assert adm.reserved(w.address) <= (adm.capacity(w) or 0)
            if live:
                adm.release(live.pop(releases.randrange(len(live))))
        fits = [i for i, n in enumerate(needs) if n <= 10]  # the largest prefill worker
        assert order == fits  # FIFO among those that fit; the rest refused at once
        assert all(adm.reserved(w.address) == 0 for w in adm.registry.workers())
        assert adm.refused["never_fits"] == len(needs) - len(fits)

    asyncio.run(scenario())


# ------------------------------------------------------------- through the router


class ExhaustedPrefill(FakePrefill):
    """A fake prefill worker whose pool is full for its first `full` calls."""

    def __init__(self, full: int = 0) -> None:
        super().__init__()
        self.full = full

    async def Prefill(self, request: Any, context: Any) -> Any:
        if self.full:
            self.full -= 1
            self.requests.append(request)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "wanted 2 KV blocks, only 0")
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
        grace_s=0.0,
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


async def test_a_full_prefill_pool_puts_the_request_back_in_the_queue(router: Any) -> None:
    pre = ExhaustedPrefill(full=2)
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
