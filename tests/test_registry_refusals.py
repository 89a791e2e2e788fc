"""The router's registry, what it keeps about workers it distrusts: refused registrations
(bounded, shown for a while), workers whose calls failed (picked last, for longer each time
they fail again soon), and encoders that process media with other settings."""

from __future__ import annotations

import dataclasses

import pytest

from common.roles import Role
from router.registry import Registry
from router.workers import RegistrationRefused, WorkerLoad
from tests.registry_helpers import Clock, info
from tests.registry_helpers import clock as clock  # fixtures: a fake clock, a registry on it
from tests.registry_helpers import registry as registry


def test_refusals_are_remembered_for_the_last_workers_only(registry: Registry) -> None:
    from router.refusals import MAX_REFUSAL_CHARS, MAX_REFUSALS

    for k in range(MAX_REFUSALS + 50):
        registry.refuse(f"10.0.0.{k}:1", "x" * 5000)
    assert len(registry.refusals) == MAX_REFUSALS
    assert "10.0.0.0:1" not in registry.refusals  # the oldest went first
    assert all(len(why) == MAX_REFUSAL_CHARS for why in registry.refusals.values())


def test_status_shows_refusals_while_the_worker_keeps_asking(
    registry: Registry, clock: Clock
) -> None:
    # A refused worker that gave up or went away was listed by `epd status` for good.
    from router.refusals import REFUSAL_SHOWN_S

    registry.refuse("10.0.0.1:1", "wrong model")
    registry.refuse("10.0.0.2:1", "wrong layout")
    clock.now += REFUSAL_SHOWN_S / 2
    registry.refuse("10.0.0.1:1", "wrong model")  # it asked again
    assert registry.refusals.recent() == [
        ("10.0.0.2:1", "wrong layout"),
        ("10.0.0.1:1", "wrong model"),
    ]
    clock.now += REFUSAL_SHOWN_S / 2 + 1
    assert registry.refusals.recent() == [("10.0.0.1:1", "wrong model")]
    clock.now += REFUSAL_SHOWN_S
    assert registry.refusals.recent() == [] and not registry.refusals


def test_a_refusal_is_news_once_then_on_a_new_reason_or_after_a_quiet_spell(
    registry: Registry, clock: Clock
) -> None:
    # The router warned of a refused worker every second, for as long as it asked (33 lines
    # in 35 s for one wrong block size: operator2 review L3, s44); the log warns of news only.
    from router.refusals import REFUSAL_SHOWN_S

    assert registry.refuse("10.0.0.1:1", "wrong model", "decode")
    clock.now += 1
    assert not registry.refuse("10.0.0.1:1", "wrong model", "decode")  # asked again
    assert registry.refuse("10.0.0.2:1", "wrong model", "decode")  # another worker
    assert registry.refuse("10.0.0.1:1", "wrong layout", "decode")  # another reason
    clock.now += REFUSAL_SHOWN_S + 1
    assert registry.refuse("10.0.0.1:1", "wrong layout", "decode")  # after a quiet spell


def test_a_request_without_a_worker_says_how_many_were_refused(
    registry: Registry, clock: Clock
) -> None:
    # Workers of a version the router refuses: clients saw only "no prefill worker is
    # registered and available", with no hint that any had tried (upgrade review).
    from router.refusals import REFUSAL_SHOWN_S
    from router.workers import NoWorkerError

    registry.refuse("10.0.0.1:1", "too old", "prefill")
    registry.refuse("10.0.0.2:1", "too old", "prefill")
    registry.refuse("10.0.0.3:1", "too old", "decode")
    with pytest.raises(NoWorkerError, match=r"available \(2 refused at registration"):
        registry.pick(Role.PREFILL)
    with pytest.raises(NoWorkerError, match=r"available$"):
        registry.pick(Role.ENCODER)
    clock.now += REFUSAL_SHOWN_S + 1  # they went away
    with pytest.raises(NoWorkerError, match=r"available$"):
        registry.pick(Role.PREFILL)


def test_a_request_without_a_worker_says_how_many_drain(registry: Registry) -> None:
    # "no decode worker is registered and available" though `epd status` listed it as
    # registered (and draining): the operator was not pointed at `epd undrain` (docswalk).
    from router.workers import NoWorkerError

    worker = registry.register(info(Role.DECODE, 3))
    registry.drain(worker.address)
    with pytest.raises(NoWorkerError, match=r"available \(1 drained: `epd undrain` takes") as e:
        registry.pick(Role.DECODE)
    assert "stopping" not in str(e.value)
    # One the deployment retires (or that stops) is not the operator's to take back.
    registry.undrain(worker.address)
    registry.retire(worker.name)
    with pytest.raises(NoWorkerError, match=r"available \(1 stopping or retired\)$"):
        registry.pick(Role.DECODE)
    # A retirement asks every router for a drain too: still not the operator's (it said
    # "1 drained: `epd undrain` takes it back", and undrain refused: raypools review, s39).
    registry.drain(worker.address)
    with pytest.raises(NoWorkerError, match=r"available \(1 stopping or retired\)$"):
        registry.pick(Role.DECODE)
    # An operator's drain on a worker that drains itself (stopping): not undrain's either.
    stopping = registry.register(info(Role.PREFILL, 5))
    registry.drain(stopping.address)
    registry.heartbeat(stopping.worker_id, WorkerLoad(draining=True))
    with pytest.raises(NoWorkerError, match=r"available \(1 stopping or retired\)$"):
        registry.pick(Role.PREFILL)


def test_a_worker_whose_call_failed_is_picked_last_until_it_heartbeats(
    registry: Registry, clock: Clock
) -> None:
    # Killed or frozen, it stays listed until its heartbeats are missed for the worker
    # timeout, and with no request on it, it was the least loaded: every request tried it
    # first meanwhile (a frozen one's calls waiting on a reconnect until it was dropped).
    a = registry.register(info(Role.PREFILL, 3))
    b = registry.register(info(Role.PREFILL, 4))
    registry.suspect(a)
    b.in_flight = 5  # busier, but trusted
    assert all(registry.pick(Role.PREFILL) is b for _ in range(3))
    assert registry.pick(Role.PREFILL, exclude=frozenset({b.address})) is a  # the last left
    registry.heartbeat(a.worker_id, WorkerLoad())  # alive after all
    assert registry.pick(Role.PREFILL) is a


def test_a_worker_suspected_again_soon_after_a_heartbeat_stays_suspect_longer(
    registry: Registry, clock: Clock
) -> None:
    # Heartbeats arrive but calls fail (a one-way partition, a wedged server beside a live
    # registrar): each heartbeat cleared the mark, so one request a second failed over on it.
    # A mark soon after the last was cleared outlasts the next heartbeats, twice as long each
    # time; one long after starts over.
    a = registry.register(info(Role.PREFILL, 3))
    b = registry.register(info(Role.PREFILL, 4))
    b.in_flight = 5  # busier, but trusted

    def suspect_after(seconds: float) -> bool:
        clock.now += seconds
        registry.heartbeat(a.worker_id, WorkerLoad())
        registry.heartbeat(b.worker_id, WorkerLoad())
        return registry.pick(Role.PREFILL) is b

    registry.suspect(a)
    assert not suspect_after(1.0)  # a first failure: cleared by the next heartbeat, as before
    registry.suspect(a)  # again, at once
    assert suspect_after(1.0) and not suspect_after(1.0)  # held 2 heartbeats
    registry.suspect(a)
    assert [suspect_after(1.0) for _ in range(4)] == [True, True, True, False]  # 4
    registry.suspect(a)
    assert suspect_after(1.0)
    assert a.suspect and a in registry.workers(Role.PREFILL)  # still listed: it heartbeats
    clock.now += 60
    registry.heartbeat(a.worker_id, WorkerLoad())  # cleared
    clock.now += 600
    registry.suspect(a)  # long after: a fresh first failure
    assert not suspect_after(1.0)
    for _ in range(2000):  # 17 hours of heartbeats while calls fail: 2 ** strikes overflowed
        registry.suspect(a)
        clock.now += 60
        registry.heartbeat(a.worker_id, WorkerLoad())
    registry.suspect(a)
    assert a.suspect


def test_an_encoder_with_other_processing_settings_is_refused_at_registration(clock) -> None:
    # Same model identity, another preprocessor_config.json (max_pixels raised on one side):
    # it registered, then refused every item it was sent as the client's INVALID_ARGUMENT.
    registry = Registry(
        worker_timeout_s=3.0, heartbeat_interval_s=1.0, expected_processor="ours", clock=clock
    )
    other = info(Role.ENCODER, 7001)
    other.processor = "theirs"
    with pytest.raises(RegistrationRefused, match="processes media with other settings"):
        registry.register(other)
    assert registry.workers() == []
    same, unknown = info(Role.ENCODER, 7002), info(Role.ENCODER, 7003)
    same.processor = "ours"
    registry.register(same)
    registry.register(unknown)  # an encoder from before the field: not compared
    assert len(registry.workers(Role.ENCODER)) == 2


def test_the_router_and_an_encoder_of_one_checkpoint_agree_on_its_settings() -> None:
    from common.models.tiny import default_checkpoint
    from common.processing.content_hash import processor_settings, settings_digest
    from common.processing.processor import Processor

    path = default_checkpoint("tiny")
    router_side = Processor.from_pretrained(path).settings
    encoder_side = processor_settings(path, Processor.from_pretrained(path).config)
    assert settings_digest(router_side) == settings_digest(encoder_side)
    changed = dataclasses.replace(encoder_side, max_pixels=encoder_side.max_pixels * 2)
    assert settings_digest(changed) != settings_digest(router_side)


def test_an_encoder_whose_handles_carry_no_digest_is_refused(registry: Registry) -> None:
    # One from before 955e247 lent digest-less handles: a prefill worker that pulled after
    # the lease ran out READ another request's rows, computed KV from them and cached it
    # (clocks review, s36: 6 of 14 answers wrong with the prefill worker held past the lease).
    with pytest.raises(RegistrationRefused, match="no 'embedding-digests' capability"):
        registry.register(info(Role.ENCODER, 1, capabilities=["patch-codes", "nixl"]))
    assert registry.workers() == []
    # Every router sends patch codes: one that does not take them is refused too.
    with pytest.raises(RegistrationRefused, match="no 'patch-codes' capability"):
        registry.register(info(Role.ENCODER, 3, capabilities=["embedding-digests"]))
    registry.register(info(Role.ENCODER, 2))  # a current one says both
