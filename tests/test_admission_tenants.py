"""`[router] tenant_share` in admission (`router.admission_tenants`): where tenants compete
for KV blocks, a request that would take its tenant past that share of a KV role's blocks
(while it holds some there) waits without holding up other tenants' requests queued behind
it; a tenant alone may take all of the KV. Against a real `Registry` whose workers heartbeat
their KV capacity in-process (`tests.test_admission`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.roles import Role
from router.admission import Admission, Need, Ticket
from router.admission_tenants import TenantShares
from router.calls import Refused, RouterError
from router.workers import WorkerLoad
from tests.test_admission import FAR, deployment, info, make, pick, settle


def of(adm: Admission, tenant: str, tokens: int) -> Any:
    """`admit` for `tenant` of a request holding `tokens` tokens' blocks (of 4) on each role:
    a prompt one token short, and two tokens asked (one token alone needs no decode)."""
    return adm.admit(tokens - 1, 2, time.monotonic() + FAR, pick(adm.registry), tenant)


def test_a_tenant_is_over_its_share_only_while_another_waits_and_it_holds_some() -> None:
    shares = TenantShares(0.5, max_queued=10)
    blocks = {Role.PREFILL: 6, Role.DECODE: 2}.__getitem__
    capacity = {Role.PREFILL: 10, Role.DECODE: 10}.__getitem__
    assert shares.queue_places == 5
    shares.take("a", Role.PREFILL, 4)
    shares.take("a", Role.DECODE, 2)
    shares.enter("a")
    assert shares.over("a", blocks, capacity) is None  # only a waits: no competition
    shares.enter("b")
    assert shares.over("a", blocks, capacity) is Role.PREFILL  # 4 + 6 > 5
    assert shares.over("a", {Role.PREFILL: 1, Role.DECODE: 4}.__getitem__, capacity) is Role.DECODE
    assert shares.over("a", blocks, lambda role: None) is None  # capacity unknown: no share
    assert shares.over("b", blocks, capacity) is None  # b holds nothing: any request
    assert shares.over(None, blocks, capacity) is None
    shares.take("a", Role.DECODE, 4)  # past its decode share (a pool that shrank)
    one_token = {Role.PREFILL: 1, Role.DECODE: 0}.__getitem__  # needs no decode blocks
    assert shares.over("a", one_token, capacity) is None
    shares.give("a", Role.DECODE, 4)
    shares.leave("b")
    shares.leave("a")
    assert shares.waiting == 0 and shares.over("a", blocks, capacity) is None
    shares.give("a", Role.PREFILL, 4)
    shares.give("a", Role.DECODE, 2)
    assert shares.blocks("a", Role.PREFILL) == 0 and shares._blocks[Role.PREFILL] == {}
    inert = TenantShares(1.0, max_queued=10)  # share 1: nothing is a tenant's
    inert.take("a", Role.PREFILL, 100)
    inert.enter("b")
    assert inert.over("a", blocks, capacity) is None and inert.queue_places == 0
    assert not inert.queue_full("a") and inert.waiting == 0


async def test_a_tenant_alone_takes_all_the_kv_and_past_its_share_lets_others_go_first() -> None:
    """16 blocks per role, a share of a half. Tenant a, alone, takes all 16; its next two
    requests wait for room, and tenant b's joins the queue behind them. When a releases 8,
    b's request is placed before a's (a would pass its share while b waits); when a
    releases the rest, a's waiting ones are placed in turn."""
    adm = make(deployment(prefill=(16,), decode=(16,)), tenant_share=0.5)
    first, second = [await asyncio.wait_for(of(adm, "a", 32), 1.0) for _ in range(2)]
    assert adm.tenants.blocks("a", Role.PREFILL) == 16 == adm.reserved("prefill-0:1")
    a_waiting = [asyncio.create_task(of(adm, "a", 32)) for _ in range(2)]
    await settle()
    b_waiting = asyncio.create_task(of(adm, "b", 32))
    await settle()
    assert adm.stats().queued == 3 and adm.tenants.waiting == 2
    adm.release(first)  # 8 free: a's first waiter would take a to 16 > 8 while b waits
    other: Ticket = await asyncio.wait_for(b_waiting, 1.0)
    assert other.tenant == "b" and not any(t.done() for t in a_waiting)
    assert adm.placed_ahead == 1
    adm.release(second)
    third: Ticket = await asyncio.wait_for(a_waiting[0], 1.0)
    adm.release(other)
    fourth: Ticket = await asyncio.wait_for(a_waiting[1], 1.0)  # a alone again: past its share
    assert adm.tenants.blocks("a", Role.DECODE) == 16
    for ticket in (third, fourth):
        adm.release(ticket)
    assert adm.tenants._blocks == {Role.PREFILL: {}, Role.DECODE: {}}
    assert adm.stats().queued == 0 and adm.tenants.waiting == 0


async def test_without_a_share_the_queue_is_first_come_first_placed() -> None:
    adm = make(deployment(prefill=(16,), decode=(16,)))  # tenant_share 1
    first, second = [await asyncio.wait_for(of(adm, "a", 32), 1.0) for _ in range(2)]
    a_waiting = asyncio.create_task(of(adm, "a", 32))
    await settle()
    b_waiting = asyncio.create_task(of(adm, "b", 32))
    await settle()
    adm.release(first)
    third: Ticket = await asyncio.wait_for(a_waiting, 1.0)  # a's, queued first
    assert not b_waiting.done() and adm.placed_ahead == 0
    adm.release(second)
    other: Ticket = await asyncio.wait_for(b_waiting, 1.0)
    for ticket in (third, other):
        adm.release(ticket)


async def test_a_request_that_waits_past_the_queue_time_over_its_share_is_refused_naming_it() -> (
    None
):
    """a holds 12 of 16 blocks; b's and c's requests of 8 wait for room, a's of 4 between
    them; a's would fit, but over a's share while others wait it is not placed ahead of
    them, and is refused naming the share (theirs, naming the blocks)."""
    adm = make(deployment(prefill=(16,), decode=(16,)), tenant_share=0.5, max_wait_s=0.3)
    held = await of(adm, "a", 48)  # 12 blocks on each role
    b_waiting = asyncio.create_task(of(adm, "b", 32))
    await settle()
    a_waiting = asyncio.create_task(of(adm, "a", 16))
    # c's wait ends well after a's: ending in one late turn of a loaded machine's loop, c's
    # refusal came first and left a alone in the queue, placed (a fresh clone's CI, s45).
    await asyncio.sleep(0.1)
    c_waiting = asyncio.create_task(of(adm, "c", 32))
    results = await asyncio.gather(b_waiting, a_waiting, c_waiting, return_exceptions=True)
    assert all(isinstance(r, Refused) for r in results), results
    b_err, a_err, c_err = map(str, results)
    assert "tenant_share" in a_err and "prefill" in a_err and "max_queue_wait_s" in a_err
    assert "no KV blocks free" in b_err and "no KV blocks free" in c_err
    assert adm.refused["queue_wait"] == 3
    adm.release(held)


async def test_with_no_live_worker_of_a_role_releases_work_and_waiters_end_unavailable() -> None:
    """The only prefill worker drains while requests of three tenants wait (shares on, so
    choosing the head needs the role's capacity): releasing and moving reservations still
    work, a cancelled waiter ends cancelled, and the others end at once with UNAVAILABLE,
    long before max_queue_wait_s."""
    adm = make(deployment(prefill=(8,), decode=(8, 8)), tenant_share=0.5, max_wait_s=5.0)
    held = await of(adm, "x", 32)  # all 8 prefill blocks
    waiting = [asyncio.create_task(of(adm, t, 16)) for t in ("y", "z", "w")]
    await settle()
    assert adm.stats().queued == 3
    adm.registry.drain("prefill-0:1")
    waiting[2].cancel()  # leaves the queue, which kicks the next head
    with pytest.raises(asyncio.CancelledError):  # not the kick's UNAVAILABLE
        await waiting[2]
    adm.move(held, Role.DECODE, adm.registry.workers(Role.DECODE)[1])
    assert adm.reserved("decode-1:1") == 8 and adm.reserved("decode-0:1") == 0
    adm.release(held)
    assert not adm._reserved and adm.tenants._blocks == {Role.PREFILL: {}, Role.DECODE: {}}
    started = time.monotonic()
    results = await asyncio.gather(*waiting[:2], return_exceptions=True)
    assert time.monotonic() - started < 1.0
    for result in results:
        assert isinstance(result, RouterError), result
        assert result.code == grpc.StatusCode.UNAVAILABLE and "prefill" in str(result)
    assert adm.stats().queued == 0 and adm.tenants.waiting == 0


async def test_a_capacity_change_that_makes_another_waiter_the_head_wakes_it() -> None:
    """x holds 4 prefill blocks and z 4 (all 8); x's next request waits, over x's share of
    the 8 while y's waits, so y's is the head. A second prefill worker of 8 registers: x's
    request is within its share of 16 now and becomes the head, with room on the new worker.
    Nobody released anything; the old head, polling, passes the wake on, so both are placed
    at once, not after max_queue_wait_s."""
    registry = deployment(prefill=(8,), decode=(100,))
    adm = make(registry, tenant_share=0.5, max_wait_s=5.0, poll_s=0.02)
    held = [await of(adm, "x", 16), await of(adm, "z", 16)]
    x_waiting = asyncio.create_task(of(adm, "x", 16))
    await settle()
    y_waiting = asyncio.create_task(of(adm, "y", 16))
    await asyncio.sleep(0.1)  # x's waiter has seen y's is the head and sleeps to its limit
    head = adm._head()
    assert head is not None and head.ticket.tenant == "y"
    record = registry.register(info(Role.PREFILL, "prefill-1:1"))
    registry.heartbeat(record.worker_id, WorkerLoad(kv_blocks_free=8))
    head = adm._head()
    assert head is not None and head.ticket.tenant == "x"
    placed = await asyncio.wait_for(asyncio.gather(x_waiting, y_waiting), 1.0)
    assert {t.workers[Role.PREFILL].address for t in placed} == {"prefill-1:1"}
    for ticket in [*held, *placed]:
        adm.release(ticket)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 40), st.integers(1, 12), st.booleans()),
        max_size=40,
    )
)
def test_the_ledger_per_tenant_adds_up_to_the_workers(
    ops: list[tuple[str, int, int, bool]],
) -> None:
    """Any run of placements and releases by three tenants on two workers per role: each
    tenant's blocks are its placed requests', they add up to the workers' reservations, no
    worker holds past its capacity, and releasing everything leaves nothing."""
    adm = make(deployment(prefill=(16, 8), decode=(12, 12)), tenant_share=0.5)
    choose = pick(adm.registry)
    held: list[Ticket] = []
    for tenant, prompt, max_tokens, release in ops:
        if release and held:
            adm.release(held.pop(0))
        else:
            ticket = Ticket(Need(prompt, max_tokens, 4), FAR, tenant)
            if adm._place(ticket, choose):
                held.append(ticket)
        for role in (Role.PREFILL, Role.DECODE):
            for t in "abc":
                mine = sum(h.need.blocks(role) for h in held if h.tenant == t)
                assert adm.tenants.blocks(t, role) == mine
            workers = adm.registry.workers(role)
            assert sum(adm.reserved(w.address) for w in workers) == sum(
                h.need.blocks(role) for h in held
            )
            assert all(adm.reserved(w.address) <= (adm.capacity(w) or 0) for w in workers)
    for ticket in held:
        adm.release(ticket)
    assert adm.tenants._blocks == {Role.PREFILL: {}, Role.DECODE: {}} and not adm._reserved
