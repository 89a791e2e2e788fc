"""The router's admission queue (`router.admission`) against a real `Registry` set up as in
`tests.test_admission`: waiters are admitted first in, first out as blocks are released; the
queue is bounded by count, by each tenant's share and by the wait; a cancelled waiter or head
frees its place; a requeued request goes back to the head after a back-off; the back-off
hint follows the recent waits; and a deadline while queued holds nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from common.roles import Role
from router.admission import Ticket
from router.calls import Refused, RouterError
from tests.test_admission import FAR, admit, deployment, make, pick, settle


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


@pytest.mark.parametrize("steps", range(2))
async def test_a_waiter_cancelled_as_its_room_frees_is_cancelled_and_holds_nothing(
    steps: int,
) -> None:
    """The caller goes away in the loop steps between the release that wakes its waiter and
    the waiter's own step: it must not be admitted (Python 3.11's `asyncio.wait_for` dropped
    such a cancellation, and the request ran on to its deadline holding its blocks)."""
    adm = make(deployment(), poll_s=10.0)
    held = await admit(adm, prompt=32)
    waiter = asyncio.create_task(admit(adm, prompt=4))
    await settle()
    adm.release(held)  # wakes the waiter
    for _ in range(steps):
        await asyncio.sleep(0)
    admitted = waiter.done()  # before the caller left: the caller holds the ticket
    waiter.cancel()
    if admitted:
        adm.release(waiter.result())
    else:
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert adm.stats().queued == 0 and adm.reserved("prefill-0:1") == 0


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


async def test_a_requeued_request_goes_at_once_to_a_worker_that_did_not_refuse_it() -> None:
    # It went back to the worker that refused it (its cached prefix drew it there) until
    # `max_queue_wait_s`, and its back-off at the head held up every request behind it.
    adm = make(deployment(prefill=(8, 8)), retry_backoff_s=0.6)
    registry = adm.registry

    def refuser_first(role: Any, exclude: frozenset[str]) -> Any:
        prefer = [w for w in registry.workers(role) if w.address not in exclude]
        return min(prefer, key=lambda w: w.address)  # prefill-0 caches the prompt

    ticket = await adm.admit(8, 1, time.monotonic() + FAR, refuser_first)
    assert ticket.workers[Role.PREFILL].address == "prefill-0:1"
    started = time.monotonic()
    await adm.requeue(ticket, refuser_first)  # prefill-0's pool was full after all
    assert time.monotonic() - started < 0.3  # no back-off: prefill-1 had room
    assert ticket.workers[Role.PREFILL].address == "prefill-1:1"
    await adm.requeue(ticket, refuser_first)  # both refused: the back-off (1 s), then either
    assert time.monotonic() - started >= 1.0
    assert ticket.workers[Role.PREFILL].address == "prefill-0:1"
    adm.release(ticket)
    assert adm.reserved("prefill-0:1") == adm.reserved("prefill-1:1") == 0


async def test_a_requeue_naming_nothing_to_avoid_still_backs_off() -> None:
    # A resumed stream's prefill holds no reservation: its requeue knew no worker to avoid
    # and was placed again at once, on the full worker, with no back-off at all.
    adm = make(deployment(prefill=(8, 8)), retry_backoff_s=0.3)
    ticket = await adm.admit(8, 1, time.monotonic() + FAR, pick(adm.registry))
    adm.release(ticket, Role.PREFILL)  # as after the decode worker took the KV lease
    started = time.monotonic()
    await adm.requeue(ticket, pick(adm.registry))
    assert time.monotonic() - started >= 0.3
    adm.release(ticket)
    # Told which worker refused (`KvPoolFull.address`), it goes to the other at once.
    ticket = await adm.admit(8, 1, time.monotonic() + FAR, pick(adm.registry))
    adm.release(ticket, Role.PREFILL)
    refused = adm.registry.workers(Role.PREFILL)[0].address
    started = time.monotonic()
    await adm.requeue(ticket, pick(adm.registry), refused)
    assert time.monotonic() - started < 0.2
    assert ticket.workers[Role.PREFILL].address != refused
    adm.release(ticket)
