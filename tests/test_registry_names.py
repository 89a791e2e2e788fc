"""Who a registration is (`router.registry`): a worker's name and address against the live
records: a restart under its name at a new address replaces the old record, an address of a
live worker is not taken by another role, and two live processes of one name do not evict
each other. Driven with a fake clock (no network)."""

from __future__ import annotations

import pytest

from common.roles import Role
from router.registry import Registry
from router.workers import RegistrationRefused, WorkerLoad
from tests.registry_helpers import Clock, info
from tests.registry_helpers import clock as clock  # fixtures: a fake clock, a registry on it
from tests.registry_helpers import registry as registry


def test_a_worker_of_the_same_name_at_a_new_address_replaces_the_old_record(
    registry: Registry,
) -> None:
    # Ray restarts a killed actor under its name on a new port: the old address is dead, so
    # it leaves routing now (and `epd status`), not after the heartbeat timeout.
    gone: list[str] = []
    registry.on_expire.append(lambda record: gone.append(record.address))
    first = info(Role.PREFILL, 3)
    first.name = "epd-prefill-0"
    other = registry.register(info(Role.PREFILL, 5))
    registry.register(first)
    again = info(Role.PREFILL, 4)
    again.name = "epd-prefill-0"
    new = registry.register(again)
    assert {w.address for w in registry.workers(Role.PREFILL)} == {other.address, new.address}
    assert gone == [first.address]
    # Another role may carry the name: not the same worker.
    encoder = info(Role.ENCODER, 6)
    encoder.name = "epd-prefill-0"
    registry.register(encoder)
    assert new in registry.workers(Role.PREFILL) and gone == [first.address]


def test_a_registration_at_a_live_workers_address_in_another_role_is_refused(
    registry: Registry, clock: Clock
) -> None:
    # Any holder of the cluster token could register an encoder at the prefill's address:
    # the prefill's record was dropped and requests found no prefill worker until its next
    # registration (security review, s32). One process serves one role.
    prefill = registry.register(info(Role.PREFILL, 9))
    with pytest.raises(RegistrationRefused, match="the address of the live prefill worker"):
        registry.register(info(Role.ENCODER, 9))
    assert registry.workers() == [prefill]
    # Once that worker is gone (silent past the timeout), the address is free for any role.
    clock.now += registry.worker_timeout_s + 1
    encoder = registry.register(info(Role.ENCODER, 9))
    assert registry.workers() == [encoder]


def test_two_live_workers_of_one_name_do_not_evict_each_other(
    registry: Registry, clock: Clock
) -> None:
    # Two processes configured with one name: the second replaces the first (it may be a
    # restart); when the first, alive, registers again, it is refused naming the clash
    # instead of evicting the second on every heartbeat.
    a = info(Role.ENCODER, 7001)
    b = info(Role.ENCODER, 7002)
    a.name = b.name = "encoder"
    a.instance_id, b.instance_id = "process-a", "process-b"
    registry.register(a)
    registry.register(b)
    with pytest.raises(RegistrationRefused, match="worker names must be unique"):
        registry.register(a)
    assert [w.address for w in registry.workers(Role.ENCODER)] == [b.address]
    # A new process at the old address (a restart, another instance) is taken.
    c = info(Role.ENCODER, 7001)
    c.name, c.instance_id = "encoder", "process-c"
    registry.register(c)
    assert [w.address for w in registry.workers(Role.ENCODER)] == [c.address]
    # The process it replaced is refused for as long as the namesake lives: its retries
    # (every few seconds) never win the name back from a worker that heartbeats.
    (namesake,) = registry.workers(Role.ENCODER)
    for _ in range(10):
        with pytest.raises(RegistrationRefused):
            registry.register(b)
        for _ in range(3):  # the namesake heartbeats; b retries after a while
            clock.now += registry.worker_timeout_s * 0.5
            assert registry.heartbeat(namesake.worker_id, WorkerLoad())
    assert [w.address for w in registry.workers(Role.ENCODER)] == [c.address]
    # Once the namesake is silent (dead), the name is taken.
    clock.now += registry.worker_timeout_s * 1.5
    registry.register(b)
    assert [w.address for w in registry.workers(Role.ENCODER)] == [b.address]
