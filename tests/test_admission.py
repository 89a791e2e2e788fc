"""The router's admission control (`router.admission`) against a real `Registry`: workers
are registered and heartbeat their KV capacity in-process, so the ledger and the refusals
are checked without any network or model: what a request needs, its reservation on both
roles, requests that can never fit, missing workers or heartbeats, and (a property test)
FIFO and the ledger for any needs. The queue's bounds, cancellation and back-off are in
`tests.test_admission_queue`; the same through a router in `tests.test_admission_router`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.roles import SIGNED_KV, Role
from common.wire.roles import role_to_proto
from epd.v1 import kv_pb2, registry_service_pb2, tensor_pb2
from router.admission import Admission, Need, Ticket
from router.calls import Refused, RouterError
from router.registry import Registry
from router.workers import WorkerLoad, WorkerRecord

MODEL = "fake-model"
BLOCK = 4
FAR = 1e9  # a deadline that never comes


def info(role: Role, address: str) -> registry_service_pb2.WorkerInfo:
    msg = registry_service_pb2.WorkerInfo(
        role=role_to_proto(role),
        address=address,
        model=MODEL,
        protocol_version="epd.v1",
        capabilities=[SIGNED_KV],
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
    # One token is prefill's alone: a prompt larger than every decode pool was refused
    # (edges review, s36), and decode blocks were held for it while it prefilled.
    assert Need(9, 1, 4).blocks(Role.DECODE) == 0


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


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "role", "need", "field"),
    [(40, 1, "prefill", 10, "messages"), (20, 30, "decode", 13, "sampling.max_tokens")],
)
async def test_a_request_that_can_never_fit_is_refused_at_once(
    prompt: int, max_tokens: int, role: str, need: int, field: str
) -> None:
    adm = make(deployment(prefill=(8, 9), decode=(12,)))
    started = time.monotonic()
    with pytest.raises(RouterError) as err:
        await admit(adm, prompt=prompt, max_tokens=max_tokens)
    assert time.monotonic() - started < 0.05
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    largest = 9 if role == "prefill" else 12
    assert f"needs {need} KV blocks of 4 tokens on a {role} worker for its prompt of" in str(
        err.value
    )
    assert f"the largest {role} worker has {largest} in all" in str(err.value)
    assert not isinstance(err.value, Refused)  # no back-off: it cannot help
    assert err.value.trailing_metadata == (("epd-field", field),)  # the only refusal naming none
    assert adm.refused["never_fits"] == 1 and adm.stats().queued == 0


async def test_one_token_fits_any_decode_pool_and_two_do_not() -> None:
    from router.admission_need import fit_to_decode

    adm = make(deployment(prefill=(20,), decode=(12,)))  # 80 and 48 tokens
    ticket = await admit(adm, prompt=60, max_tokens=1)
    assert adm.reserved("prefill-0:1") == 15 and adm.reserved("decode-0:1") == 0
    adm.release(ticket)
    with pytest.raises(RouterError, match="needs 16 KV blocks of 4 tokens on a decode worker"):
        await admit(adm, prompt=60, max_tokens=2)
    # The prompt leaves no room for a token of decode's (past the pool, or filling it): a
    # default length is not cut to one token; the prompt is what to make smaller, and the
    # refusal names no length (it would be a default the caller never sent).
    for prompt in (60, 48):
        with pytest.raises(RouterError) as err:
            await admit(adm, prompt=prompt, max_tokens=fit_to_decode(16, prompt, 4, [12]))
        assert err.value.trailing_metadata == (("epd-field", "messages"),)
        assert "max_tokens" not in str(err.value)
        blocks = (prompt + 1 + 3) // 4
        assert (
            f"needs {blocks} KV blocks of 4 tokens on a decode worker for its prompt of "
            f"{prompt} tokens and one generated token; the largest decode worker has 12"
            in str(err.value)
        )
    assert fit_to_decode(16, 47, 4, [12]) == 2  # room for one token of decode's


async def test_the_refusal_of_a_prompt_names_the_field_it_came_in() -> None:
    adm = make(deployment(prefill=(20,), decode=(12,)))
    for role_full, prompt in (("decode", 48), ("prefill", 81)):
        with pytest.raises(RouterError) as err:
            await adm.admit(prompt, 16, FAR, pick(adm.registry), prompt_field="prompt")
        assert err.value.trailing_metadata == (("epd-field", "prompt"),), role_full
        assert f"on a {role_full} worker for its prompt of {prompt} tokens" in str(err.value)


async def test_a_worker_gone_between_the_room_check_and_the_pick_reserves_nothing() -> None:
    # Expired between `_live` and the pick (the registry reads its clock each time): the
    # prefill reservation was made, then the decode pick raised NoWorkerError, leaking the
    # reservation and the tenant's blocks, and the client got UNKNOWN.
    from router.workers import NoWorkerError

    adm = make(deployment())
    registry = adm.registry

    def choose(role: Role, exclude: frozenset[str]) -> WorkerRecord:
        if role is Role.DECODE:
            raise NoWorkerError(role)  # it expired a moment ago
        return registry.pick(role, exclude=exclude)

    waiting = asyncio.ensure_future(adm.admit(9, 8, time.monotonic() + 0.3, choose, "a"))
    await settle()
    assert adm.reserved("prefill-0:1") == 0 and adm.stats().queued == 1  # waits for room
    with pytest.raises(RouterError):
        await waiting
    assert adm.reserved("prefill-0:1") == 0 and adm.reserved("decode-0:1") == 0
    assert not any(adm.tenants.blocks("a", role) for role in (Role.PREFILL, Role.DECODE))


async def test_no_worker_of_a_role_is_unavailable() -> None:
    adm = make(deployment(decode=()))
    with pytest.raises(RouterError) as err:
        await admit(adm, prompt=4, max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker" in str(err.value)


async def test_a_one_token_answer_needs_no_decode_worker() -> None:
    # Prefill's token is the answer: it was refused with no decode worker up, and counted
    # as placed on one (its load for the pick) while it prefilled.
    registry = deployment(decode=(8,))
    adm = make(registry)
    ticket = await admit(adm, prompt=4, max_tokens=1)
    assert set(ticket.workers) == {Role.PREFILL}
    assert [w.placed for w in registry.workers(Role.DECODE)] == [0]
    adm.release(ticket)
    adm = make(deployment(decode=()))
    ticket = await admit(adm, prompt=4, max_tokens=1)
    assert adm.reserved("prefill-0:1") == 1


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

    ticket = await adm.admit(24, 2, time.monotonic() + FAR, choose)  # 6 blocks, 7 on decode
    assert seen == [frozenset({"prefill-0:1"}), frozenset()]
    assert ticket.workers[Role.PREFILL].address == "prefill-1:1"
    adm.move(ticket, Role.PREFILL, adm.registry.workers(Role.PREFILL)[0])  # a retry
    assert adm.reserved("prefill-0:1") == 6 and adm.reserved("prefill-1:1") == 0
    adm.release(ticket)


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


async def test_requests_placed_but_not_started_count_as_load() -> None:
    # A burst sharing a cached prefix all went to the worker caching it: admission places a
    # request's prefill and decode workers long before their calls start (and count), so
    # every request of the burst saw the same idle loads and the slack never applied.
    from router.prefix_index import PrefixIndex
    from router.routing import Chooser

    registry = deployment(prefill=(1000,) * 3, decode=(1000,) * 3)
    prefix = PrefixIndex(channels=None)  # type: ignore[arg-type]  # never subscribes
    hashes = [bytes([k]) * 32 for k in range(4)]
    stored = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=hashes)
    prefix._apply("prefill-0:1", [stored])
    prefix._apply("decode-0:1", [stored])
    adm = make(registry)
    tickets = [
        await adm.admit(16, 4, time.monotonic() + FAR, Chooser(registry, prefix, hashes))
        for _ in range(12)
    ]
    for role in (Role.PREFILL, Role.DECODE):
        placed = [w.placed for w in registry.workers(role)]
        assert sum(placed) == 12 and max(placed) - min(placed) <= 2 + 1  # the slack
        assert registry.workers(role)[0].placed == max(placed)  # the cache still draws
    adm.move(tickets[0], Role.DECODE, registry.workers(Role.DECODE)[2])
    for ticket in tickets:
        adm.release(ticket)
    assert all(w.placed == 0 and w.load_estimate == 0 for w in registry.workers())


def test_a_default_length_is_cut_to_the_largest_pool() -> None:
    # A chat with no max_tokens was refused for a default it never sent. Cut to the room
    # free now instead, ordinary answers came out short whenever the pool was busy.
    from router.admission_need import fit_to_decode

    block = 16
    assert fit_to_decode(1024, 100, block, [None, 64]) == 1024  # not heard of yet
    assert fit_to_decode(1024, 100, block, [128, 64]) == 1024  # fits: unchanged
    assert fit_to_decode(1024, 500, block, [64, 40]) == 64 * block - 500 + 1
    # The prompt alone passes every pool: kept, and refused naming `messages` (cut to one
    # token, prefill alone answered it with that token: ownfix review B).
    assert fit_to_decode(1024, 5000, block, [64, 64]) == 1024
