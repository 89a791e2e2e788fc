"""Requests wait out the restart of a role's last worker (`router.returns`): when the only
decode worker was killed and came back 16 s later, every request meanwhile failed at once
(91 of them), though `request_timeout_s` was 300 s."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc.aio import Metadata
from prometheus_client import generate_latest

from common.roles import Role
from common.sampling import SamplingParams
from common.server.rpc import start_server
from router.calls import suspect_if_failed
from router.registry import Registry
from router.returns import RESTART_WINDOW_S, STARTUP_S, Returns
from router.workers import WorkerLoad
from tests.registry_helpers import Clock, info
from tests.registry_helpers import clock as clock  # fixtures: a fake clock, a registry on it
from tests.registry_helpers import registry as registry
from tests.test_router import (
    FIRST,
    IMAGE,
    TEXT,
    FakeDecode,
    FakeEncoder,
    FakePrefill,
    start_router,
)


def test_a_role_is_restarting_only_when_it_lost_a_worker_lately(registry, clock: Clock) -> None:
    returns = Returns(5.0, registry)
    # A router this new: its workers are still to register (a restarted router refused
    # requests in the half second before they did; churn review).
    assert returns.restarting(Role.DECODE)
    clock.now += STARTUP_S
    assert not returns.restarting(Role.DECODE)  # never had one: not restarting
    gone = registry.register(info(Role.DECODE, 3))
    assert not returns.restarting(Role.DECODE)
    clock.now += registry.worker_timeout_s + 1
    registry.expire()  # dropped for silence
    assert returns.restarting(Role.DECODE)
    back = registry.register(info(Role.DECODE, 4))  # registered again, on another port
    assert not returns.restarting(Role.DECODE)
    clock.now += registry.worker_timeout_s + 1
    registry.expire()
    clock.now += RESTART_WINDOW_S
    assert not returns.restarting(Role.DECODE)  # lost too long ago: not coming back
    drained = registry.register(info(Role.PREFILL, 5))
    registry.drain(drained.address)
    clock.now += registry.worker_timeout_s + 1
    registry.expire()
    assert not returns.restarting(Role.PREFILL)  # it left on purpose
    assert gone.address != back.address
    # Lost, back under its name (another port), then retired (a scale to 0): nothing to
    # wait for (each request waited `max_wait_s`: raypools review, s39).
    lost = registry.register(info(Role.ENCODER, 6))
    clock.now += registry.worker_timeout_s + 1
    registry.expire()
    moved = info(Role.ENCODER, 7)
    moved.name = lost.name
    registry.retire(lost.name)
    registry.register(moved)  # back, and retiring
    clock.now += registry.worker_timeout_s + 1
    registry.expire()  # it left
    assert not returns.restarting(Role.ENCODER)


@pytest.mark.parametrize("hold", ["drain", "retire"])
def test_another_workers_registration_ends_no_loss(registry, clock: Clock, hold: str) -> None:
    # Any registration of the role ended its loss: an operator's drained worker restarted
    # for maintenance (or a retiring one registering again) made requests fail at once while
    # the lost worker was still restarting (ownfixH review, s39).
    returns = Returns(5.0, registry)
    clock.now += STARTUP_S
    lost = registry.register(info(Role.DECODE, 3))
    held = registry.register(info(Role.DECODE, 4))
    if hold == "drain":
        registry.drain(held.address)
    else:
        registry.retire(held.name)
    clock.now += registry.worker_timeout_s + 1
    registry.heartbeat(held.worker_id, WorkerLoad())
    registry.expire()
    assert registry.workers(Role.DECODE) == [held] and returns.restarting(Role.DECODE)
    assert registry.register(info(Role.DECODE, 4)).draining  # registered again, held
    assert returns.restarting(Role.DECODE)  # the lost one is still to come back
    assert lost.name not in (w.name for w in registry.workers(Role.DECODE))


def test_a_suspect_worker_counts_as_gone_only_once_it_is_silent(registry, clock: Clock) -> None:
    returns = Returns(5.0, registry)
    worker = registry.register(info(Role.DECODE, 3))
    registry.suspect(worker)  # a call failed: wedged, or dead
    assert not returns.restarting(Role.DECODE)
    clock.now += 3 * registry.heartbeat_interval_s  # and no heartbeat since: dead
    assert returns.restarting(Role.DECODE)
    registry.heartbeat(worker.worker_id, WorkerLoad())
    assert not returns.restarting(Role.DECODE)


async def test_a_worker_that_cannot_be_connected_to_is_gone_at_once(registry, clock: Clock) -> None:
    # A killed worker refuses connections at once, but counted as gone only after two
    # heartbeats of silence: meanwhile requests failed at once instead of waiting for it.
    # (A connect reset, as after a local server's stop, says the same.)
    returns = Returns(5.0, registry)
    worker = registry.register(info(Role.DECODE, 3))
    suspect_if_failed(registry, worker, await failed_call("127.0.0.1:1"))  # nothing there
    assert worker.suspect and worker.unreachable
    assert returns.restarting(Role.DECODE)  # no heartbeat missed yet
    registry.heartbeat(worker.worker_id, WorkerLoad())  # it was back after all
    assert not worker.unreachable and not returns.restarting(Role.DECODE)
    other = registry.register(info(Role.DECODE, 4))
    wedged = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(), "keepalive")
    suspect_if_failed(registry, other, wedged)  # a call failed some other way: suspect only
    assert other.suspect and not other.unreachable
    # A call in flight when the process was killed: its connection reset, the first failure
    # the router sees (kill review: requests arriving after it failed, not waited).
    cut = "Stream removed (recvmsg:Connection reset by peer)"
    suspect_if_failed(
        registry,
        other,
        grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(), cut),
    )
    assert other.unreachable


async def test_a_live_worker_relaying_a_lost_connection_is_not_unreachable(registry) -> None:
    # A live worker may answer UNAVAILABLE in those words (a peer's failure it relays, or a
    # fake's): counted as gone, the role's only worker made every request wait out the
    # queue's 60 s for a restart that never came. Its channel, connected, says otherwise.
    worker = registry.register(info(Role.PREFILL, 3))
    cut = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(), "Socket closed")
    running = await start_server([])
    try:
        async with grpc.aio.insecure_channel(running.address) as ch:
            await ch.channel_ready()
            suspect_if_failed(registry, worker, cut, ch)
            assert worker.suspect and not worker.unreachable
        async with grpc.aio.insecure_channel("127.0.0.1:1") as ch:  # nothing listens there
            suspect_if_failed(registry, worker, cut, ch)
            assert worker.unreachable
    finally:
        await running.stop(0)


async def failed_call(address: str) -> grpc.aio.AioRpcError:
    """The error of a call to `address` (where nothing listens)."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await ch.unary_unary("/x.Y/Z")(b"", timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc
    raise AssertionError("the call succeeded")


def test_a_worker_silent_past_its_timeout_is_lost_before_the_expiry_pass(
    registry, clock: Clock
) -> None:
    # Hidden from `workers` at its timeout but marked lost only by the next expiry pass (up
    # to a second later): in between, the role was not restarting, so waiting requests were
    # let go to fail UNAVAILABLE and new ones failed at once (recovery review: 3 of 3 kills).
    returns = Returns(5.0, registry)
    for port, suspect in ((3, True), (4, False)):  # a call failed on it, or none did
        worker = registry.register(info(Role.DECODE, port))
        if suspect:
            registry.suspect(worker)
        clock.now += registry.worker_timeout_s + 0.1  # silent past the timeout
        assert registry.workers(Role.DECODE) == []
        assert returns.restarting(Role.DECODE)  # before any `expire`
        registry.expire()
        assert returns.restarting(Role.DECODE)
        returns.lost.clear()


async def test_the_wait_ends_at_a_registration_or_the_bound(registry, clock: Clock) -> None:
    returns = Returns(0.3, registry)
    clock.now += STARTUP_S  # (a new router's roles all restart)
    registry.register(info(Role.DECODE, 3))
    clock.now += registry.worker_timeout_s + 1
    registry.expire()
    started = time.monotonic()
    await returns.wait([Role.DECODE], time.monotonic() + 10)  # nobody comes back: the bound
    assert 0.25 < time.monotonic() - started < 2 and returns.waited == 1

    async def come_back() -> None:
        await asyncio.sleep(0.2)
        registry.register(info(Role.DECODE, 4))

    returns.max_wait_s = 10
    back = asyncio.create_task(come_back())
    started = time.monotonic()
    await returns.wait([Role.DECODE], time.monotonic() + 3.0)
    assert 0.15 < time.monotonic() - started < 0.9
    await back
    started = time.monotonic()
    await returns.wait([Role.DECODE, Role.PREFILL], started + 10)  # prefill never had one
    assert time.monotonic() - started < 0.1


async def test_the_wait_is_bounded_in_count_by_the_deadline_and_by_a_drain(
    registry, clock: Clock
) -> None:
    # Requests waiting skipped admission: 1000 of them waited with max_queued_requests 8,
    # each polling every 50 ms; a client's short deadline came back DEADLINE_EXCEEDED (no
    # failover) instead of UNAVAILABLE; a draining router waited its whole drain.
    returns = Returns(10.0, registry, max_waiting=3)
    registry.register(info(Role.DECODE, 3))
    clock.now += registry.worker_timeout_s + 1
    registry.expire()

    def waiter() -> asyncio.Task[None]:
        return asyncio.create_task(returns.wait([Role.DECODE], time.monotonic() + 30))

    waiters = [waiter(), waiter()]
    draining = False
    drained = asyncio.create_task(
        returns.wait([Role.DECODE], time.monotonic() + 30, lambda: draining)
    )
    await asyncio.sleep(0.05)
    assert returns.waiting == 3
    draining = True
    await asyncio.wait_for(drained, 2)  # seen at its next look (CHECK_S)
    started = time.monotonic()
    await returns.wait([Role.DECODE], started + 0.5)  # a deadline within the margin: at once
    waiters.append(waiter())
    await asyncio.sleep(0.05)
    await returns.wait([Role.DECODE], started + 30)  # a fourth: past max_waiting, at once
    assert time.monotonic() - started < 0.2 and returns.waiting == 3
    registry.register(info(Role.DECODE, 4))  # back: the waiters go at once, not polled
    await asyncio.wait_for(asyncio.gather(*waiters), 0.2)
    assert returns.waiting == 0


def silence(registry: Registry, role: Role) -> None:
    """`role`'s workers killed: their heartbeats stopped past the timeout, and dropped."""
    for worker in registry.workers(role):
        worker.last_seen -= registry.worker_timeout_s + 1
    registry.expire()


async def test_a_request_waits_for_the_decode_worker_that_restarts(ckpt) -> None:
    cluster = await start_router(ckpt)
    try:
        await cluster.add(Role.PREFILL, FakePrefill())
        await cluster.add(Role.DECODE, FakeDecode())
        registry = cluster.router.registry
        silence(registry, Role.DECODE)
        assert registry.workers(Role.DECODE) == []
        answer = asyncio.create_task(
            cluster.client.generate_text(TEXT, SamplingParams(max_tokens=3))
        )
        await asyncio.sleep(0.5)
        assert not answer.done()  # waiting, not failed UNAVAILABLE at once
        # One token is prefill's alone: served at once (it waited for decode: ownfixG, s39).
        started = time.monotonic()
        one = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=1))
        assert one.token_ids == [FIRST] and time.monotonic() - started < 1.0
        await cluster.add(Role.DECODE, FakeDecode())  # back, on another port
        result = await asyncio.wait_for(answer, 10)
        assert result.token_ids == [FIRST, 101, 102]
        assert cluster.router.servicer.returns.waited == 1
        page = generate_latest(cluster.router.orchestrator.metrics.registry).decode()
        assert "epd:requests_waited_for_worker_total 1.0" in page
    finally:
        await cluster.close()


async def test_an_image_request_waits_for_the_encoder_that_restarts(ckpt) -> None:
    # Only prefill and decode were waited for: with one encoder, every image request during
    # its 5 s restart failed at once (recovery review). A text request does not wait for it.
    cluster = await start_router(ckpt)
    try:
        await cluster.add(Role.ENCODER, FakeEncoder())
        await cluster.add(Role.PREFILL, FakePrefill())
        await cluster.add(Role.DECODE, FakeDecode())
        silence(cluster.router.registry, Role.ENCODER)
        text = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=2))
        assert text.token_ids == [FIRST, 101]  # needs no encoder: served at once
        answer = asyncio.create_task(
            cluster.client.generate_text(IMAGE, SamplingParams(max_tokens=2))
        )
        await asyncio.sleep(0.5)
        assert not answer.done()  # waiting, not failed UNAVAILABLE at once
        encoder = FakeEncoder()
        await cluster.add(Role.ENCODER, encoder)  # back, on another port
        result = await asyncio.wait_for(answer, 10)
        assert result.token_ids == [FIRST, 101] and len(encoder.requests) == 1
        assert cluster.router.servicer.returns.waited == 1
    finally:
        await cluster.close()


@pytest.mark.parametrize("role", [Role.ENCODER, Role.PREFILL, Role.DECODE])
async def test_a_request_whose_worker_is_killed_waits_for_its_return(ckpt, role: Role) -> None:
    # The role's only worker is gone (killed: connections refused or reset). The request
    # whose own call found out failed, though the worker was back seconds later (1-8 per
    # kill, kill review), and so did the next ones for two heartbeat intervals: each waits.
    fakes = {Role.ENCODER: FakeEncoder, Role.PREFILL: FakePrefill, Role.DECODE: FakeDecode}
    cluster = await start_router(ckpt)
    try:
        for each in (Role.ENCODER, Role.PREFILL, Role.DECODE):
            await cluster.add(each, fakes[each]())
        killed = cluster.servers[[Role.ENCODER, Role.PREFILL, Role.DECODE].index(role)]
        await killed.stop(0)
        chat = IMAGE if role == Role.ENCODER else TEXT
        answers = [
            asyncio.create_task(cluster.client.generate_text(chat, SamplingParams(max_tokens=2)))
            for _ in range(3)
        ]
        await asyncio.sleep(0.5)
        assert not any(a.done() for a in answers)  # waiting, not failed UNAVAILABLE
        (worker,) = cluster.router.registry.workers(role, timed_out=True)
        assert worker.unreachable
        await cluster.add(role, fakes[role]())  # back, on another port
        for answer in answers:
            assert (await asyncio.wait_for(answer, 10)).token_ids == [FIRST, 101]
    finally:
        await cluster.close()


async def test_past_max_waiting_a_request_fails_at_once_and_the_log_says_it_did_not_wait(
    registry, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # With max_queued_requests 0 the log said "waiting for one back" for requests that
    # failed at once (openai review F5, s44).
    from router.calls import RouterError, WorkerCalls

    calls = WorkerCalls(registry)
    calls.returns = returns = Returns(10.0, registry, max_waiting=0)
    registry.register(info(Role.DECODE, 3))
    clock.now += registry.worker_timeout_s + 1
    registry.expire()
    assert returns.restarting(Role.DECODE) and returns.full

    def pick() -> None:
        raise RouterError(grpc.StatusCode.UNAVAILABLE, "no decode worker")

    started = time.monotonic()
    with caplog.at_level("INFO", "router.calls"), pytest.raises(RouterError):
        await calls.pick_or_return(Role.DECODE, set(), started + 30, pick)  # type: ignore[arg-type]
    assert time.monotonic() - started < 0.2
    assert "not waiting: 0 wait already (max_queued_requests: 0)" in caplog.text
    assert "waiting for one back" not in caplog.text
