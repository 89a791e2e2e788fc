"""The registry's holds that outlast a worker's record, and its expiry after the router's own
loop stalled: an operator's drain kept under the worker's name across its restarts, a
retiring worker that no undrain puts back, and heartbeats that waited unread while the
router stalled (fake clock, no network)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

from common.roles import Role
from epd.v1 import registry_service_pb2
from router.departures import expire_loop
from router.registry import Registry
from router.workers import WorkerLoad, WorkerRecord
from tests.registry_helpers import Clock, info
from tests.registry_helpers import clock as clock  # fixtures: a fake clock, a registry on it
from tests.registry_helpers import registry as registry


def named(role: Role, port: int, name: str, instance: str) -> registry_service_pb2.WorkerInfo:
    msg = info(role, port)
    msg.name, msg.instance_id = name, instance
    return msg


def _orchestrator() -> SimpleNamespace:
    return SimpleNamespace(
        prefix=SimpleNamespace(forget=lambda address: None),
        channels=SimpleNamespace(keep_only=lambda addresses: None),
    )


async def test_a_router_that_stalled_keeps_the_workers_whose_heartbeats_waited(
    registry: Registry, clock: Clock
) -> None:
    # The router's loop stopped longer than the worker timeout (GC, CPU starvation,
    # SIGSTOP): on waking, its expiry ran before the heartbeats waiting in the sockets and
    # dropped every worker at once, breaking every request in flight.
    gone: list[WorkerRecord] = []
    registry.on_expire.append(gone.append)
    a = registry.register(info(Role.PREFILL, 3))
    b = registry.register(info(Role.DECODE, 4))
    loop = asyncio.create_task(expire_loop(registry, _orchestrator(), 0.01))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0)  # the loop notes the time and sleeps
        clock.now += 7.0  # the router stalls 7 s (worker timeout: 3 s)
        await asyncio.sleep(0.05)  # it wakes late, and passes run before the heartbeats
        assert gone == []
        assert {w.worker_id for w in registry.workers()} == {a.worker_id, b.worker_id}
        assert registry.heartbeat(a.worker_id, WorkerLoad())  # a waiting heartbeat, read
        # Running on time again, a worker that stays silent is dropped after the timeout.
        for _ in range(8):
            clock.now += 0.5  # late by less than a heartbeat interval: no stall
            assert registry.heartbeat(a.worker_id, WorkerLoad())
            await asyncio.sleep(0.03)
    finally:
        loop.cancel()
    assert gone == [b]


async def test_a_stall_shorter_than_a_heartbeat_interval_is_excused_too(clock: Clock) -> None:
    # With a heartbeat of 3 s and a timeout of 5 s, a worker may be 3 s from its timeout
    # when the loop sleeps: a stall of 2.9 s (not "past a heartbeat interval") dropped it.
    registry = Registry(worker_timeout_s=5.0, heartbeat_interval_s=3.0, clock=clock)
    gone: list[WorkerRecord] = []
    registry.on_expire.append(gone.append)
    registry.register(info(Role.PREFILL, 3))
    clock.now += 2.9  # its next heartbeat is due in 0.1 s
    loop = asyncio.create_task(expire_loop(registry, _orchestrator(), 0.01))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0)
        clock.now += 2.9  # the router stalls: that heartbeat waits unread
        await asyncio.sleep(0.05)
    finally:
        loop.cancel()
    assert gone == []


async def test_a_dead_worker_is_dropped_though_every_pass_runs_late(
    registry: Registry, clock: Clock, caplog: Any
) -> None:
    # Each late pass excused its lateness again: a dead worker stayed routable 54 s with a
    # 5 s timeout (passes 8 s late), and its drop said "no heartbeat for 6.0 s".
    gone: list[WorkerRecord] = []
    registry.on_expire.append(gone.append)
    dead = registry.register(info(Role.DECODE, 4))  # timeout 3 s
    start = clock.now
    loop = asyncio.create_task(expire_loop(registry, _orchestrator(), 0.01))  # type: ignore[arg-type]
    try:
        for _ in range(20):
            await asyncio.sleep(0)
            clock.now += 2.0  # every pass 2 s late
            await asyncio.sleep(0.02)
            if gone:
                break
    finally:
        loop.cancel()
    assert gone == [dead] and clock.now - start <= 2 * registry.worker_timeout_s + 2.0
    assert f"no heartbeat for {clock.now - start:.1f} s" in caplog.text


def test_an_operators_drain_stands_when_the_worker_restarts_under_its_name(
    registry: Registry, clock: Clock
) -> None:
    # Ray restarts a crashed actor under its name on a new port: the drain (most likely put
    # on because something was wrong with that worker) was dropped and it came back serving.
    other = registry.register(info(Role.PREFILL, 5))
    first = registry.register(named(Role.PREFILL, 3, "epd-prefill-1", "process-1"))
    assert registry.drain(first.address)
    moved = registry.register(named(Role.PREFILL, 4, "epd-prefill-1", "process-2"))
    assert moved.draining and registry.drained_by_operator("epd-prefill-1")
    assert {registry.pick(Role.PREFILL).address for _ in range(3)} == {other.address}
    # A new process at the same address, and one that comes back after being dropped for
    # silence, stay drained too.
    assert registry.register(named(Role.PREFILL, 4, "epd-prefill-1", "process-3")).draining
    clock.now += 10
    registry.expire()
    back = registry.register(named(Role.PREFILL, 6, "epd-prefill-1", "process-4"))
    assert back.draining
    # Only Undrain clears it, for the worker's later restarts too.
    assert registry.undrain(back.address) == (True, True, False)
    assert not registry.drained_by_operator("epd-prefill-1")
    assert not registry.register(named(Role.PREFILL, 7, "epd-prefill-1", "process-5")).draining
    # The name is the worker's in its role: an encoder of that name is another worker.
    registry.drain("127.0.0.1:7")
    assert not registry.register(named(Role.ENCODER, 8, "epd-prefill-1", "process-6")).draining


def test_undrain_of_a_worker_that_left_clears_its_drain(registry: Registry, clock: Clock) -> None:
    first = registry.register(named(Role.DECODE, 3, "epd-decode-0", "process-1"))
    registry.drain(first.address)
    clock.now += 10
    registry.expire()
    assert registry.undrain(first.address) == (False, False, True)  # gone, but undrained
    assert not registry.register(named(Role.DECODE, 4, "epd-decode-0", "process-2")).draining


def test_undrain_by_name_lifts_the_drain_of_a_worker_that_is_away(
    registry: Registry, clock: Clock
) -> None:
    # Drained, then killed: while Ray restarts it, no worker of its name is registered, and
    # an undrain by name found nothing to tell: it came back drained.
    first = registry.register(named(Role.DECODE, 3, "epd-decode-0", "process-1"))
    registry.drain(first.address)
    clock.now += 10
    registry.expire()
    assert registry.undrain(name="epd-decode-1") == (False, False, False)  # another name
    assert registry.undrain(name="epd-decode-0") == (False, False, True)
    assert not registry.register(named(Role.DECODE, 4, "epd-decode-0", "process-2")).draining
    assert registry.undrain(name="epd-decode-0") == (True, True, False)  # nothing held now


def test_a_retiring_worker_stays_out_of_rotation_whatever_undrain_says(
    registry: Registry,
) -> None:
    # A scale-down's first phase holds the worker out only through the router: undrain put
    # it back in rotation, `epd status` called it serving, and its retirement waited the
    # whole drain timeout for requests that kept coming.
    other = registry.register(info(Role.DECODE, 5))
    leaving = registry.register(named(Role.DECODE, 3, "epd-decode-1", "process-1"))
    registry.retire("epd-decode-1")
    assert leaving.draining and not registry.drained_by_operator("epd-decode-1")
    assert registry.undrain(leaving.address) == (True, False, False)  # found, still draining
    assert leaving.draining
    assert {registry.pick(Role.DECODE).address for _ in range(3)} == {other.address}
    # Registering again (a missed heartbeat, a restart) does not make it serve.
    assert registry.register(named(Role.DECODE, 3, "epd-decode-1", "process-1")).draining
    assert registry.register(named(Role.DECODE, 4, "epd-decode-1", "process-2")).draining


def test_a_worker_retired_before_it_registered_registers_retiring(registry: Registry) -> None:
    # A scale-down retired a worker still loading its model: once up, it must take no work.
    registry.retire("epd-prefill-2")
    assert registry.register(named(Role.PREFILL, 3, "epd-prefill-2", "process-1")).draining
    assert not registry.register(named(Role.PREFILL, 4, "epd-prefill-3", "process-2")).draining


def test_a_worker_held_out_for_its_death_is_dropped_as_dead_not_retired(
    registry: Registry, clock: Clock, caplog: Any
) -> None:
    # Its registration timing out logged "retired ... (drained, stopped)": it had died
    # (ownfixB review F5, s40).
    dead = registry.register(named(Role.PREFILL, 3, "epd-prefill-0", "p0"))
    leaving = registry.register(named(Role.PREFILL, 4, "epd-prefill-1", "p1"))
    registry.retire("epd-prefill-0", died=True)
    registry.retire("epd-prefill-1")
    assert dead.draining and dead.died and not leaving.died
    clock.now += 2 * registry.worker_timeout_s
    with caplog.at_level(logging.INFO, logger="router.registry"):
        assert {r.name for r in registry.expire()} == {"epd-prefill-0", "epd-prefill-1"}
    # Named as operators look for them, by name too (operator2 review L6, s44).
    assert f"dropped prefill worker {dead.shown}: it died for good" in caplog.text
    assert f"retired prefill worker {leaving.shown} (drained, stopped)" in caplog.text
    assert "retired prefill worker " + dead.shown not in caplog.text
    assert dead.shown == f"epd-prefill-0 ({dead.address})"
    # A Register in flight when it died comes back held out as dead (ownfixB, s41).
    late = registry.register(named(Role.PREFILL, 5, "epd-prefill-0", "p0"))
    assert late.draining and late.died


def test_retirements_do_not_push_an_operators_drain_out(registry: Registry) -> None:
    # A scale-down's own Drain of each retiring worker was filed as an operator's: after
    # 256 retirements the operator's drain was forgotten (the worker came back serving from
    # a restart, and a scale-down kept it).
    from router.drains import MAX_HELD

    drained = registry.register(named(Role.PREFILL, 3, "epd-prefill-0", "p0"))
    registry.drain(drained.address)
    for k in range(MAX_HELD + 10):
        leaving = registry.register(named(Role.DECODE, 100 + k, f"epd-decode-{k}", f"d{k}"))
        registry.retire(leaving.name)
        registry.drain(leaving.address)  # the pool's drain at the router
        registry.remove(leaving.worker_id)
    assert registry.drained_by_operator("epd-prefill-0")


def test_a_decode_retry_skips_a_worker_whose_pool_cannot_hold_the_request(
    registry: Registry,
) -> None:
    # A stream moved off its failed decode worker went to the least loaded one, a pool too
    # small for it, and failed mid-answer though a larger decode worker served.
    from router.admission import Admission
    from router.calls import WorkerCalls
    from router.decode import DecodeStage
    from router.workers import WorkerLoad

    failed = registry.register(info(Role.DECODE, 3))
    small = registry.register(info(Role.DECODE, 4))
    large = registry.register(info(Role.DECODE, 5))
    registry.heartbeat(small.worker_id, WorkerLoad(kv_blocks_free=8))
    registry.heartbeat(large.worker_id, WorkerLoad(kv_blocks_free=64, active_requests=3))
    admission = Admission(registry, max_queued=8, max_wait_s=1.0)
    stage = DecodeStage(registry, WorkerCalls(registry), None, admission, None)  # type: ignore[arg-type]
    assert stage._pick({failed.address}, set(), need=20) is large
    assert stage._pick({failed.address}, set(), need=4) is small  # it holds that: least loaded
