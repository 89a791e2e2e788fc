"""The router's worker registry: compatibility checks, heartbeats, expiry, draining and
least-loaded selection, driven with a fake clock (no network)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Collection
from types import SimpleNamespace

import pytest

from common.roles import Role
from epd.v1 import registry_service_pb2, tensor_pb2
from router.departures import expire_loop
from router.registry import Registry
from router.workers import (
    NoWorkerError,
    RegistrationRefused,
    WorkerLoad,
    WorkerRecord,
)
from tests.registry_helpers import Clock, info, layout
from tests.registry_helpers import clock as clock  # fixtures: a fake clock, a registry on it
from tests.registry_helpers import registry as registry


def test_register_and_pick(registry: Registry) -> None:
    enc = registry.register(info(Role.ENCODER, 1))
    pre = registry.register(info(Role.PREFILL, 2))
    assert registry.pick(Role.ENCODER) is enc
    assert registry.pick(Role.PREFILL) is pre
    with pytest.raises(NoWorkerError, match="no decode worker"):
        registry.pick(Role.DECODE)
    assert [w.role for w in registry.workers()] == [Role.ENCODER, Role.PREFILL]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"protocol_version": "epd.v2"}, "speaks protocol 'epd.v2'"),
        ({"model": "other"}, "serves model 'other'"),
        ({"kv_layout": layout(num_layers=3)}, r"num_layers=3 \(checkpoint has 2\)"),
        ({"kv_layout": layout(head_dim=8)}, r"head_dim=8 \(checkpoint has 16\)"),
        # Without the signed-kv label (before d53a527, some of which sign without saying so).
        ({"capabilities": ["nixl"]}, "upgrade workers before routers"),
    ],
)
def test_mismatch_is_refused(registry: Registry, overrides: dict, message: str) -> None:
    with pytest.raises(RegistrationRefused, match=message):
        registry.register(info(Role.PREFILL, 2, **overrides))
    assert registry.workers() == []


def test_kv_layout_must_match_the_first_kv_worker(registry: Registry) -> None:
    registry.register(info(Role.PREFILL, 2))
    refused = r"block_size=8 \(expected 16\).*keeps its first KV worker's until it restarts"
    with pytest.raises(RegistrationRefused, match=refused):
        registry.register(info(Role.DECODE, 3, kv_layout=layout(block_size=8, block_bytes=4096)))
    registry.register(info(Role.DECODE, 4))  # a matching one is fine
    assert [w.address for w in registry.workers(Role.DECODE)] == ["127.0.0.1:4"]


def test_every_worker_computes_in_the_deployments_dtype(clock: Clock) -> None:
    # Encoders in float32 and in bfloat16 were both taken: one request got two answers, and
    # whichever came first was cached for both (configs review, s32).
    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=clock)
    registry.register(info(Role.ENCODER, 1, dtype="bfloat16"))
    with pytest.raises(RegistrationRefused, match=r"computes in float32; .* compute in bfloat16"):
        registry.register(info(Role.ENCODER, 2, dtype="float32"))
    # A KV worker's dtype is its layout's.
    with pytest.raises(RegistrationRefused, match=r"prefill worker .* computes in float32"):
        registry.register(info(Role.PREFILL, 3))
    bf16 = layout(dtype=tensor_pb2.ELEMENT_TYPE_BFLOAT16, block_bytes=4096)
    registry.register(info(Role.PREFILL, 4, kv_layout=bf16))
    registry.register(info(Role.ENCODER, 5))  # an older encoder says none: not compared
    assert {w.address for w in registry.workers()} == {"127.0.0.1:1", "127.0.0.1:4", "127.0.0.1:5"}


def test_a_stray_encoders_dtype_goes_with_it(clock: Clock) -> None:
    # The first dtype said was kept for the router's life: one stray encoder of another
    # dtype, gone since, kept every rightly configured worker out (own-fix review 3).
    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=clock)
    registry.register(info(Role.ENCODER, 1, dtype="bfloat16"))
    clock.now += 10  # it stopped heartbeating: kept out only while it is registered (a
    with pytest.raises(RegistrationRefused):  # heartbeat would revive it), until expired
        registry.register(info(Role.PREFILL, 2))
    registry.expire()
    registry.register(info(Role.PREFILL, 2))  # float32, as the deployment is meant to be
    registry.register(info(Role.ENCODER, 3, dtype="float32"))
    assert registry.dtype_now() == "float32"
    # A KV layout is kept for the router's life, and its dtype with it.
    clock.now += 10
    registry.expire()
    with pytest.raises(RegistrationRefused, match="keeps its first KV worker's until it restarts"):
        registry.register(info(Role.ENCODER, 4, dtype="bfloat16"))


def test_a_kv_layout_refusal_names_the_dtype(registry: Registry) -> None:
    registry.register(info(Role.PREFILL, 2))
    bf16 = layout(dtype=tensor_pb2.ELEMENT_TYPE_BFLOAT16, block_bytes=4096)
    with pytest.raises(RegistrationRefused, match=r"dtype=bfloat16 \(expected float32\)"):
        registry.register(info(Role.DECODE, 3, kv_layout=bf16))


def test_model_is_adopted_from_the_first_worker_when_not_given(clock: Clock) -> None:
    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, clock=clock)
    registry.register(info(Role.ENCODER, 1, model="m1"))
    assert registry.expected_model == "m1"
    with pytest.raises(RegistrationRefused, match="serves model 'm2'"):
        registry.register(info(Role.ENCODER, 2, model="m2"))


def test_incomplete_registration_is_a_value_error(registry: Registry) -> None:
    bad = info(Role.PREFILL, 2)
    bad.ClearField("kv_layout")
    with pytest.raises(ValueError, match="kv_layout is missing"):
        registry.register(bad)
    with pytest.raises(ValueError, match="role"):
        registry.register(registry_service_pb2.WorkerInfo(address="x:1", protocol_version="epd.v1"))


def test_reregistering_replaces_the_old_record(registry: Registry) -> None:
    old = registry.register(info(Role.DECODE, 3))
    new = registry.register(info(Role.DECODE, 3))
    assert old.worker_id != new.worker_id
    assert registry.workers(Role.DECODE) == [new]
    assert not registry.heartbeat(old.worker_id, WorkerLoad())


def test_silent_workers_expire(registry: Registry, clock: Clock) -> None:
    a = registry.register(info(Role.DECODE, 3))
    b = registry.register(info(Role.DECODE, 4))
    clock.now += 2.0
    assert registry.heartbeat(b.worker_id, WorkerLoad())
    clock.now += 2.0  # a silent for 4 s > 3 s, b for 2 s
    assert registry.expire() == [a]
    assert registry.pick(Role.DECODE) is b
    assert not registry.heartbeat(a.worker_id, WorkerLoad())  # it must register again


def test_least_loaded_wins_and_ties_rotate(registry: Registry) -> None:
    a = registry.register(info(Role.DECODE, 3))
    b = registry.register(info(Role.DECODE, 4))
    picks = [registry.pick(Role.DECODE).address for _ in range(4)]
    assert picks == [a.address, b.address, a.address, b.address]
    with registry.using(a):
        assert registry.pick(Role.DECODE) is b
        with registry.using(b), registry.using(b):
            assert registry.pick(Role.DECODE) is a
    assert a.in_flight == b.in_flight == 0


def test_heartbeat_load_counts_other_work_once(registry: Registry) -> None:
    a = registry.register(info(Role.PREFILL, 3))
    b = registry.register(info(Role.PREFILL, 4))
    with registry.using(a):
        # a reports our one request: not counted twice.
        registry.heartbeat(a.worker_id, WorkerLoad(active_requests=1))
        assert a.load_estimate == 1
        # b is busy with three requests from elsewhere.
        registry.heartbeat(b.worker_id, WorkerLoad(active_requests=3))
        assert b.load_estimate == 3
        assert registry.pick(Role.PREFILL) is a


def test_draining_workers_get_no_new_work(registry: Registry) -> None:
    a = registry.register(info(Role.ENCODER, 1))
    b = registry.register(info(Role.ENCODER, 2))
    assert registry.drain(a.address)
    assert not registry.drain("127.0.0.1:99")
    assert {registry.pick(Role.ENCODER).address for _ in range(3)} == {b.address}
    registry.heartbeat(b.worker_id, WorkerLoad(draining=True))  # reported by the worker
    with pytest.raises(NoWorkerError):
        registry.pick(Role.ENCODER)
    assert [w.draining for w in registry.workers()] == [True, True]


def test_an_operators_drain_survives_the_same_process_registering_again(
    registry: Registry,
) -> None:
    same = info(Role.ENCODER, 1)
    same.instance_id = "process-1"
    other = registry.register(info(Role.ENCODER, 2))
    registry.register(same)
    assert registry.drain(same.address)
    # A missed heartbeat makes the worker register again: still drained.
    registry.register(same)
    assert {w.address: w.draining for w in registry.workers(Role.ENCODER)} == {
        other.address: False,
        same.address: True,
    }
    assert {registry.pick(Role.ENCODER).address for _ in range(3)} == {other.address}
    # A new process of that name at that address (a restart) stays drained too.
    restarted = info(Role.ENCODER, 1)
    restarted.instance_id = "process-2"
    registry.register(restarted)
    (again,) = [w for w in registry.workers(Role.ENCODER) if w.address == same.address]
    assert again.draining


def test_an_operators_drain_survives_the_same_process_missing_its_heartbeats(
    registry: Registry, clock: Clock
) -> None:
    # Dropped for silence (a long GC pause, a partition) and registering again, the process
    # came back serving: the operator's drain was lost with its record.
    same = info(Role.ENCODER, 1)
    same.instance_id = "process-1"
    registry.register(same)
    registry.drain(same.address)
    clock.now += 10
    assert [w.address for w in registry.expire()] == [same.address]
    registry.register(same)
    assert [w.draining for w in registry.workers(Role.ENCODER)] == [True]
    found, _, _ = registry.undrain(same.address)
    assert found
    clock.now += 10
    registry.expire()
    registry.register(same)  # undrained before it went: serving again
    assert [w.draining for w in registry.workers(Role.ENCODER)] == [False]


def test_pick_excludes_addresses(registry: Registry) -> None:
    a = registry.register(info(Role.PREFILL, 3))
    registry.register(info(Role.PREFILL, 4))
    assert registry.pick(Role.PREFILL, exclude=frozenset({"127.0.0.1:4"})) is a
    with pytest.raises(NoWorkerError):
        registry.pick(Role.PREFILL, exclude=frozenset({"127.0.0.1:3", "127.0.0.1:4"}))


def test_affinity_wins_within_the_load_slack(registry: Registry) -> None:
    a = registry.register(info(Role.PREFILL, 3))
    b = registry.register(info(Role.PREFILL, 4))
    cached = {a.address: 0, b.address: 5}
    assert registry.pick(Role.PREFILL, affinity=lambda w: cached[w.address]) is b
    with registry.using(b), registry.using(b):
        assert registry.pick(Role.PREFILL, affinity=lambda w: cached[w.address]) is b
        with registry.using(b):  # three more than a: past the slack of two
            assert registry.pick(Role.PREFILL, affinity=lambda w: cached[w.address]) is a


def test_a_lookup_hides_a_silent_worker_but_leaves_its_expiry_to_expire(
    registry: Registry, clock: Clock
) -> None:
    gone: list[WorkerRecord] = []
    registry.on_expire.append(gone.append)
    a = registry.register(info(Role.DECODE, 3))
    clock.now += 4.0
    assert registry.workers() == []  # hidden at once, from selection too
    with pytest.raises(NoWorkerError):
        registry.pick(Role.DECODE)
    assert gone == []  # a lookup only filters
    assert registry.expire() == [a]
    assert gone == [a]
    assert registry.expire() == [] and gone == [a]


async def test_the_expire_loop_forgets_a_worker_a_lookup_saw_dead_first(
    registry: Registry,
) -> None:
    class Forgets:
        def __init__(self) -> None:
            self.addresses: list[str] = []

        def forget(self, address: str) -> None:
            self.addresses.append(address)

    class Channels:
        def __init__(self, open_: set[str]) -> None:
            self.open = open_

        def keep_only(self, addresses: Collection[str]) -> None:
            self.open &= set(addresses)

    dead = registry.register(info(Role.PREFILL, 3))
    live = registry.register(info(Role.PREFILL, 4))
    # A release sent after some worker left opened a channel to its address again.
    channels = Channels({dead.address, live.address, "127.0.0.1:9"})
    orchestrator = SimpleNamespace(prefix=Forgets(), channels=channels)
    loop = asyncio.create_task(expire_loop(registry, orchestrator, 0.01))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0)  # the loop subscribes before its first sleep
        dead.last_seen -= 4.0  # silent for 4 s (a jump of the clock would be a stall)
        assert registry.pick(Role.PREFILL) is live  # a request sees `dead` gone first
        for _ in range(100):
            if orchestrator.prefix.addresses:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.03)
    finally:
        loop.cancel()
    assert orchestrator.prefix.addresses == [dead.address]
    assert channels.open == {live.address}  # none left to an address no worker holds


def test_a_scrape_thread_reads_the_workers_while_the_loop_registers(registry: Registry) -> None:
    # The metrics thread lists the workers at scrape time while the event loop registers
    # and drops them: iterating the dict itself failed a scrape now and then ("dictionary
    # changed size during iteration"). Thread switches forced often to make it show.
    for port in range(40):
        registry.register(info(Role.PREFILL, 30000 + port))
    errors: list[str] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                for role in Role:
                    registry.workers(role)
                registry.workers()
            except RuntimeError as exc:
                errors.append(str(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        end = time.monotonic() + 1.5
        i = 0
        while time.monotonic() < end:
            record = registry.register(info(Role.DECODE, 40000 + i % 50))
            registry.remove(record.worker_id)
            i += 1
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert errors == []
