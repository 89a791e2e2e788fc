"""`common.server.leases.LeaseTable` with lease ids its callers choose: a release that comes
before the lease bars the id, so the lease is never made (what a router whose Prefill call
was cancelled relies on); barred ids are forgotten after the TTL and bounded in number."""

from __future__ import annotations

import asyncio

import pytest

from common.server import leases
from common.server.leases import LeaseIdError, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_caller_chosen_id_names_the_lease() -> None:
    table: LeaseTable[str] = LeaseTable(5.0)
    lease = table.add("blocks", "r1", lease_id="mine-1")
    assert lease.lease_id == "mine-1" and "mine-1" in table
    assert table.pop_or_bar("mine-1") is lease and "mine-1" not in table
    assert table.released == 1


def test_a_peers_request_id_is_kept_for_logs_cut_and_escaped() -> None:
    # Written raw into the expiry line: a line break split it, 100 k characters grew the log
    # by as much (fuzz review, s37; the router refuses such ids, a peer need not).
    from common.server.rpc import logged

    table: LeaseTable[str] = LeaseTable(5.0)
    lease = table.add("blocks", "r\nINFO forged" + "x" * 100_000)
    assert lease.request_id.startswith("r\\nINFO forged") and lease.request_id.endswith("...")
    assert len(lease.request_id) < 220 and "\n" not in lease.request_id
    assert logged("r-1") == "r-1" and logged("\u202e") == "\\u202e"


def test_a_release_before_the_lease_bars_its_id_for_the_ttl() -> None:
    clock = Clock()
    table: LeaseTable[str] = LeaseTable(5.0, clock)
    assert table.pop_or_bar("early") is None  # nothing live: the id is barred instead
    with pytest.raises(LeaseIdError) as refused:
        table.add("blocks", "r1", lease_id="early")
    assert refused.value.reason == "released" and len(table) == 0
    clock.now += 4.9
    with pytest.raises(LeaseIdError):
        table.check("early")
    clock.now += 0.2  # past the TTL: forgotten
    assert table.add("blocks", "r1", lease_id="early").lease_id == "early"


def test_live_and_malformed_ids_are_refused_and_nothing_is_added() -> None:
    table: LeaseTable[str] = LeaseTable(5.0)
    table.add("first", lease_id="dup")
    with pytest.raises(LeaseIdError) as live:
        table.add("second", lease_id="dup")
    assert live.value.reason == "live" and table.pop("dup") is not None
    for bad in ("", "x" * 65, "a b", "ünï", "id/1"):
        with pytest.raises(LeaseIdError, match="malformed"):
            table.add("blocks", lease_id=bad)
    assert len(table) == 0
    assert len(table.add("blocks").lease_id) == 32  # no id given: a random one


def test_barred_ids_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "MAX_BARRED", 3)
    table: LeaseTable[str] = LeaseTable(5.0)
    for i in range(5):
        table.pop_or_bar(f"id-{i}")
    table.check("id-0")  # the two oldest were forgotten
    table.check("id-1")
    for i in (2, 3, 4):
        with pytest.raises(LeaseIdError):
            table.check(f"id-{i}")


def test_a_renewal_gives_a_lease_the_lifetime_it_was_given() -> None:
    # A prefill worker gives leases more time while many are live; a waiting decode
    # worker renews every third of that time. Renewing to the table's shorter TTL let
    # such a lease run out however often it was renewed.
    clock = Clock()
    table: LeaseTable[str] = LeaseTable(3.0, clock)
    table.add("blocks", "r1", ttl_s=12.0, lease_id="long")
    for _ in range(10):
        clock.now += 4.0  # a third of its lifetime
        renewed = table.renew("long")
        assert renewed is not None and renewed.expires_at == clock.now + 12.0
    assert table.pop_expired() == []
    shorter = table.renew("long", ttl_s=1.0)
    assert shorter is not None and shorter.expires_at == clock.now + 12.0  # never earlier


def test_an_expired_lease_not_yet_reaped_is_not_renewed() -> None:
    # Revived, it would keep blocks the reaper was about to free, for a reader the holder
    # already gave up on; no test held it (flaky review, s33).
    clock = Clock()
    table: LeaseTable[str] = LeaseTable(1.0, clock)
    table.add("blocks", "r", lease_id="a")
    clock.now += 2.0
    assert table.renew("a") is None
    assert [lease.lease_id for lease in table.pop_expired()] == ["a"]


async def test_stopping_the_reaper_mid_way_leaves_the_rest_to_shutdown() -> None:
    # The reaper used to take every expired lease out of the table at once, then free them
    # one by one: stopped in between, the rest were lost to the worker's shutdown.
    clock = Clock()
    table: LeaseTable[str] = LeaseTable(1.0, clock)
    for i in range(3):
        table.add(f"blocks-{i}", f"r{i}")
    freed: list[str] = []

    async def free(lease: leases.Lease[str]) -> None:
        await asyncio.sleep(0.05)
        freed.append(lease.held)

    table.start_reaper(free, 0.01)
    clock.now += 5.0  # all three expire
    await asyncio.sleep(0.03)  # the reaper is freeing the first
    await table.stop_reaper()
    # The one being freed when stopped (a worker's release runs on, shielded); the others
    # are still in the table for shutdown to free.
    assert sorted(lease.held for lease in table.pop_all()) == ["blocks-1", "blocks-2"]
    assert table.expired == 1 and freed == []


def test_a_release_of_an_id_no_lease_could_have_bars_nothing() -> None:
    # The barred ids are bounded by count; an id `add` would refuse anyway (too long, odd
    # characters) is not kept, so a release cannot make one huge.
    table: LeaseTable[str] = LeaseTable(5.0)
    for bad in ("x" * 100_000, "a b", ""):
        assert table.pop_or_bar(bad) is None
    assert len(table._barred) == 0
    table.pop_or_bar("fine-id")
    assert list(table._barred) == ["fine-id"]


async def test_a_lease_made_under_a_due_ones_id_while_the_reaper_runs_is_kept() -> None:
    # The reaper frees due leases one at a time, awaiting each: a lease released meanwhile
    # and made anew under its id (ids are the caller's) must not be freed with the old
    # one's turn. Nothing pinned it (mutation review, s36).
    clock = Clock()
    table: LeaseTable[str] = LeaseTable(1.0, clock)
    table.add("a", lease_id="a")
    table.add("b", lease_id="b")
    clock.now += 1.0  # both due
    freed: list[str] = []
    made = asyncio.Event()

    async def on_expire(lease: leases.Lease[str]) -> None:
        freed.append(lease.held)
        if lease.held == "a":  # b's reader releases it; a new lease takes its id
            assert table.pop("b") is not None
            table._barred.clear()  # its bar forgotten (past MAX_BARRED of them)
            table.add("b2", lease_id="b")
            made.set()

    table.start_reaper(on_expire, interval_s=0.01)
    async with asyncio.timeout(2):
        await made.wait()
    await asyncio.sleep(0.05)
    await table.stop_reaper()
    assert freed == ["a"] and "b" in table  # the new lease "b" lives on


def test_a_chosen_id_is_barred_once_its_lease_is_released_or_expired() -> None:
    # Leased again under the id, a new lease answered the old lease's reader that its lease
    # was live throughout its READ, though it had expired before (s42 kvtrust review).
    clock = Clock()
    table: LeaseTable[str] = LeaseTable(5.0, clock)
    table.add("blocks", "r1", lease_id="released")
    table.add("blocks", "r2", lease_id="expired", ttl_s=2.0)
    table.add("blocks", "r3", ttl_s=2.0)  # the table's own id: never chosen, never barred
    assert table.pop_or_bar("released") is not None
    clock.now += 2.0
    assert len(table.pop_expired()) == 2
    for lease_id in ("released", "expired"):
        with pytest.raises(LeaseIdError) as refused:
            table.add("other blocks", "r4", lease_id=lease_id)
        assert refused.value.reason == "released"
    assert sorted(table._barred) == ["expired", "released"] and len(table) == 0
    clock.now += 3.1  # each forgotten a TTL after its lease went
    assert table.add("blocks", "r5", lease_id="released").lease_id == "released"
    with pytest.raises(LeaseIdError):
        table.check("expired")


async def test_a_chosen_id_the_reaper_frees_is_barred() -> None:
    clock = Clock()
    table: LeaseTable[str] = LeaseTable(1.0, clock)
    table.add("a", lease_id="reaped")
    clock.now += 1.0
    freed: list[str] = []

    async def on_expire(lease: leases.Lease[str]) -> None:
        freed.append(lease.held)

    table.start_reaper(on_expire, interval_s=0.01)
    async with asyncio.timeout(2):
        while not freed:
            await asyncio.sleep(0.01)
    await table.stop_reaper()
    with pytest.raises(LeaseIdError):
        table.add("b", lease_id="reaped")
