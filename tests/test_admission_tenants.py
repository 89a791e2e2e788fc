"""`[router] tenant_share` in admission (`router.admission_tenants`): one tenant reserves at
most that share of each KV role's blocks (unless it holds none there), and its requests past
the share wait without holding up other tenants' requests queued behind them. Against a real
`Registry` whose workers heartbeat their KV capacity in-process (`tests.test_admission`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.roles import Role
from router.admission import Admission, Need, Ticket
from router.admission_tenants import TenantShares
from router.calls import Refused
from tests.test_admission import FAR, deployment, make, pick, settle


def of(adm: Admission, tenant: str, prompt: int, max_tokens: int = 1) -> Any:
    """`admit` of `prompt` tokens for `tenant` (blocks of 4 tokens)."""
    return adm.admit(prompt, max_tokens, time.monotonic() + FAR, pick(adm.registry), tenant)


def test_a_tenant_passes_its_share_only_while_it_holds_some_of_the_role() -> None:
    shares = TenantShares(0.5, max_queued=10)
    blocks = {Role.PREFILL: 6, Role.DECODE: 2}.__getitem__
    capacity = {Role.PREFILL: 10, Role.DECODE: 10}.__getitem__
    assert shares.queue_places == 5
    assert shares.over("a", blocks, capacity) is None  # holds nothing: any request fits
    shares.take("a", Role.PREFILL, 4)
    shares.take("a", Role.DECODE, 2)
    assert shares.over("a", blocks, capacity) is Role.PREFILL  # 4 + 6 > 5
    assert shares.over("a", {Role.PREFILL: 1, Role.DECODE: 4}.__getitem__, capacity) is Role.DECODE
    assert shares.over("a", blocks, lambda role: None) is None  # capacity unknown: no share
    assert (
        shares.over("b", blocks, capacity) is None and shares.over(None, blocks, capacity) is None
    )
    shares.give("a", Role.PREFILL, 6)
    shares.give("a", Role.DECODE, 2)
    assert shares.blocks("a", Role.PREFILL) == 0 and shares._blocks[Role.PREFILL] == {}
    inert = TenantShares(1.0, max_queued=10)  # share 1: nothing is a tenant's
    inert.take("a", Role.PREFILL, 100)
    assert inert.over("a", blocks, capacity) is None and inert.queue_places == 0
    assert not inert.queue_full("a")


async def test_a_tenant_at_its_kv_share_waits_while_others_are_placed_past_it() -> None:
    """16 blocks per role, a share of a half: tenant a holds 8 prefill blocks; its next
    request waits though the workers have room, and tenant b's, queued behind it, is placed
    at once; once a releases, its waiting request is placed."""
    adm = make(deployment(prefill=(16,), decode=(16,)), tenant_share=0.5)
    first = await of(adm, "a", 24)  # 6 blocks on each role
    second = await of(adm, "a", 8)  # 8 in all: a's whole share
    assert adm.tenants.blocks("a", Role.PREFILL) == 8 and adm.reserved("prefill-0:1") == 8
    waiting = asyncio.create_task(of(adm, "a", 4))  # 9 > 8: waits, though 8 blocks are free
    await settle()
    assert not waiting.done() and adm.stats().queued == 1
    other: Ticket = await asyncio.wait_for(of(adm, "b", 16), 1.0)  # behind it, placed now
    assert other.tenant == "b" and adm.tenants.blocks("b", Role.DECODE) == 4
    assert not waiting.done()
    adm.release(first)
    third: Ticket = await asyncio.wait_for(waiting, 1.0)
    assert adm.tenants.blocks("a", Role.PREFILL) == 3  # 2 + 1
    for ticket in (second, third, other):
        adm.release(ticket)
    assert adm.tenants._blocks == {Role.PREFILL: {}, Role.DECODE: {}}
    assert adm.stats().queued == 0 and adm.tenants.waiting == 0


async def test_a_request_past_the_share_runs_alone_and_without_a_share_nothing_waits() -> None:
    adm = make(deployment(prefill=(16,), decode=(16,)), tenant_share=0.5)
    whole = await asyncio.wait_for(of(adm, "a", 48), 1.0)  # 12 blocks > 8, a holds nothing
    adm.release(whole)
    unshared = make(deployment(prefill=(16,), decode=(16,)))  # tenant_share 1
    tickets = [await asyncio.wait_for(of(unshared, "a", 24), 1.0) for _ in range(2)]
    assert unshared.reserved("prefill-0:1") == 12  # one tenant may take it all
    for ticket in tickets:
        unshared.release(ticket)


async def test_a_request_that_waits_past_the_queue_time_at_its_share_is_refused_naming_it() -> None:
    adm = make(deployment(prefill=(16,), decode=(16,)), tenant_share=0.5, max_wait_s=0.2)
    held = await of(adm, "a", 32)  # its whole share of both roles
    with pytest.raises(Refused) as err:
        await of(adm, "a", 4)
    message = str(err.value)
    assert "tenant_share" in message and "prefill" in message and "max_queue_wait_s" in message
    assert adm.refused["queue_wait"] == 1 and err.value.trailing_metadata[0][0] == "retry-after-ms"
    adm.release(held)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 40), st.integers(1, 12), st.booleans()),
        max_size=40,
    )
)
def test_no_tenant_holds_past_its_share_but_for_a_lone_request(
    ops: list[tuple[str, int, int, bool]],
) -> None:
    """Any run of placements and releases by three tenants on two workers per role: a
    tenant past its share of a role holds one request there, the ledger per tenant adds up
    to the workers', and no worker holds past its capacity."""
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
        for role, capacity in ((Role.PREFILL, 24), (Role.DECODE, 24)):
            for t in "abc":
                mine = [h for h in held if h.tenant == t]
                assert adm.tenants.blocks(t, role) == sum(h.need.blocks(role) for h in mine)
                assert adm.tenants.blocks(t, role) <= 0.5 * capacity or len(mine) == 1
            workers = adm.registry.workers(role)
            assert sum(adm.reserved(w.address) for w in workers) == sum(
                h.need.blocks(role) for h in held
            )
            assert all(adm.reserved(w.address) <= adm.capacity(w) for w in workers)  # type: ignore[operator]
