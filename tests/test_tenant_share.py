"""`[router] tenant_share`: where the API keys name several client tenants, one holds at most
that share of `requests_in_flight_mb` and of the gRPC reads it allows (`router.held`), so a
tenant that announces bodies it does not send, or opens calls it never sends a request on,
cannot take the front doors from the others; and of the KV blocks admitted requests reserve
(`router.admission_tenants`, and `tests/test_admission_tenants.py`)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.processing.messages import messages_from_dicts
from common.roles import Role
from common.sampling import SamplingParams
from common.server.auth import Authenticator
from common.server.credentials import bearer_metadata
from common.settings.api_keys import ApiKey
from epd.client import Client
from router.admission import Need
from router.held import HeldBytes
from router.workers import WorkerLoad
from tests.cluster import CLIENT_KEY, OTHER_KEY, TEST_KEYS
from tests.test_bad_input import grpc_request
from tests.test_http_api import MODEL_ID, add_workers, call, fake_router, url_of
from tests.test_http_connections import host_port, metrics_page
from tests.test_requests_in_flight import nothing_sent, raw_generate
from tests.test_router import TEXT
from tests.test_router import Cluster as FakeCluster


def test_a_tenant_holds_at_most_its_share_unless_it_holds_nothing_else() -> None:
    held = HeldBytes(100, tenant_share=0.5)
    assert held.take(60, tenant="a")  # the tenant's only request: past its share, taken
    assert not held.take(1, tenant="a")  # one more of it: refused
    assert held.take(5, mine=60, tenant="a")  # the request holding all of a's may grow
    assert held.take(30, tenant="b")  # another tenant: its own share
    assert not held.take(10, tenant="b")  # the bound (100) refuses this one
    held.give(65, tenant="a")
    assert held.take(20, tenant="b") and not held.take(1, tenant="b")  # b at its 50
    assert held.take(40, tenant="a") and held.by_tenant == {"a": 40, "b": 50}
    held.give(40, tenant="a")
    held.give(50, tenant="b")
    assert held.held == 0 and held.by_tenant == {}
    whole = HeldBytes(100)  # tenant_share 1: one tenant may hold all of it
    assert whole.take(60, tenant="a") and whole.take(40, tenant="a") and not whole.by_tenant


def test_the_share_applies_where_several_tenants_have_client_keys() -> None:
    """`epd serve`'s own keys (a client tenant and an admin one) are one client tenant: its
    one client may hold all of the bound; the test deployment's keys have two."""
    served = Authenticator(None, [ApiKey.of("c", "default"), ApiKey.of("a", "admin", True)])
    assert served.client_tenants == 1
    assert Authenticator(None, [ApiKey.of(k, t, a) for k, t, a in TEST_KEYS]).client_tenants == 2


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Return once `condition()` holds (the router runs on this event loop); fail after
    `seconds`."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {seconds} s")


def completion(c: FakeCluster, key: str) -> tuple[int, object]:
    body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}
    status, _, reply = call(f"{url_of(c)}/v1/completions", body, key)
    return status, reply


@pytest.fixture
async def small(ckpt: Path) -> AsyncIterator[FakeCluster]:
    """8 MiB of requests held at most, half of it by one tenant (the default share), four
    gRPC reads at once (2 MiB requests of the 8 MiB bound), two of them by one tenant."""
    c = await fake_router(ckpt, max_message_mb=2, requests_in_flight_mb=8, request_timeout_s=3.0)
    await add_workers(c)
    yield c
    await c.close()


async def test_a_tenant_announcing_bodies_it_does_not_send_leaves_the_others_theirs(
    small: FakeCluster,
) -> None:
    held = small.router.servicer.held
    assert (held.tenant_limit, held.tenant_reads) == (4 << 20, 2)
    admission = small.router.servicer.orchestrator.admission
    assert admission.tenants.queue_places == 256  # half of max_queued_requests (512)
    admit, tenants = admission.admit, []

    async def admit_recording(*args: Any) -> Any:
        tenants.append(args[4])  # whose share of the queue a request would wait in
        return await admit(*args)

    admission.admit = admit_recording  # type: ignore[method-assign,assignment]
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {CLIENT_KEY}\r\nContent-Length: {2 << 20}\r\n\r\n"
    )
    # Two bodies of tenant-a announced at the largest size, and trickled: its whole share.
    stalled = [socket.create_connection(host_port(small)) for _ in range(2)]
    try:
        for sock in stalled:
            sock.sendall(head.encode() + json.dumps({"model": MODEL_ID}).encode()[:5])
        await until(lambda: held.by_tenant == {"tenant-a": 4 << 20})  # as announced
        status, reply = await asyncio.to_thread(completion, small, CLIENT_KEY)
        assert status == 429 and "tenant_share" in str(reply), reply  # tenant-a: its share
        assert (await asyncio.to_thread(completion, small, OTHER_KEY))[0] == 200  # tenant-b
    finally:
        for sock in stalled:
            sock.close()
    for _ in range(100):  # tenant-a's bytes come back once the router sees it gone
        if not held.by_tenant:
            break
        await asyncio.sleep(0.05)
    assert (await asyncio.to_thread(completion, small, CLIENT_KEY))[0] == 200
    assert tenants == ["tenant-b", "tenant-a"]  # the two requests admitted


async def test_a_tenant_holding_its_reads_leaves_the_others_theirs(small: FakeCluster) -> None:
    raw = raw_generate(small)
    tenant_a, tenant_b = bearer_metadata(CLIENT_KEY), bearer_metadata(OTHER_KEY)
    # Two calls of tenant-a that never send their request hold its two reads.
    stalled = [raw(nothing_sent(), metadata=tenant_a) for _ in range(2)]
    held = small.router.servicer.held
    await until(lambda: "tenant-a" in held._reads_of and held._reads_of["tenant-a"].users == 2)
    await until(lambda: held.waiting == 0)  # both read now
    request = grpc_request(request_id="b")
    request.messages[0].content.add(text="hi")
    b_answer = small.client._router.Generate(request, metadata=tenant_b)
    assert (await asyncio.wait_for(b_answer.read(), 2.0)).token_ids  # a free read: served
    b_answer.cancel()
    a_request = grpc_request(request_id="a")
    a_request.messages[0].content.add(text="hi")
    a_answer = asyncio.ensure_future(
        small.client._router.Generate(a_request, metadata=tenant_a).read()
    )
    await until(lambda: held.waiting == 1)
    assert not a_answer.done()  # behind tenant-a's own reads, though two others are free
    # It waits in tenant-a's one place to wait (half of the bound's 8 MiB / 4 MiB windows):
    # one more is refused at once, though the router has another place.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await small.client._router.Generate(a_request, metadata=tenant_a).read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting to be read" in (err.value.details() or "")
    assert (held.max_waiting, held.tenant_waiting, held.waiting) == (2, 1, 1)
    for call_ in stalled:  # each gives its read back when its request's time is up
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call_.read()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await asyncio.wait_for(a_answer, 10)).token_ids
    assert small.router.servicer.held._reads_of == {}  # no read held, none waiting


async def test_a_tenant_holding_the_kv_lets_another_go_first_when_blocks_free(ckpt: Path) -> None:
    """Workers with room for four requests: tenant-a, alone, takes all four (they hang in
    prefill holding their KV reservations); its fifth waits for room, and tenant-b's, sent
    after it, waits behind it. When one of tenant-a's ends, tenant-b's is admitted first
    (tenant-a would pass its share while tenant-b waits) and reaches prefill. (Waits are
    long: a busy machine slows the router's steps, not their order.)"""
    c = await fake_router(ckpt, request_timeout_s=10.0)
    pre, _ = await add_workers(c)
    other = Client(c.router.address, api_key=OTHER_KEY)
    try:
        orchestrator = c.router.servicer.orchestrator
        prompt = orchestrator.processor.process(messages_from_dicts(TEXT))
        need = Need(len(prompt.prompt_token_ids), 4, 16)
        for w in c.router.registry.workers():  # four requests' blocks on each KV worker
            w.load = WorkerLoad(kv_blocks_free=4 * need.blocks(Role.DECODE))
        pre.hang = True
        sampling = SamplingParams(max_tokens=4)
        a_held = [asyncio.create_task(c.client.generate_text(TEXT, sampling)) for _ in range(4)]
        await until(lambda: len(pre.requests) == 4, 20)
        admission = orchestrator.admission
        assert admission.tenants.blocks("tenant-a", Role.DECODE) == 4 * need.blocks(Role.DECODE)
        a_fifth = asyncio.create_task(c.client.generate_text(TEXT, sampling))
        await until(lambda: admission.stats().queued == 1, 20)
        b_call = asyncio.create_task(other.generate_text(TEXT, sampling))
        await until(lambda: admission.stats().queued == 2, 20)
        a_held[0].cancel()
        await until(lambda: len(pre.requests) == 5, 20)  # tenant-b's, ahead of tenant-a's fifth
        assert admission.stats().queued == 1 and not a_fifth.done()
        salts = [r.cache_salt for r in pre.requests]  # each tenant's prompts salted its own
        assert len(set(salts[:4])) == 1 and salts[4] != salts[0]  # the fifth is tenant-b's
        assert admission.tenants.blocks("tenant-b", Role.DECODE) == need.blocks(Role.DECODE)
        page = await asyncio.to_thread(metrics_page, url_of(c))
        assert "epd:admission_placed_ahead_total 1.0" in page
        for task in (*a_held, a_fifth, b_call):
            task.cancel()
        await asyncio.gather(*a_held, a_fifth, b_call, return_exceptions=True)
        await until(lambda: admission.stats().queued == 0 and not admission._reserved, 20)
    finally:
        await other.close()
        await c.close()


async def test_media_read_from_urls_count_in_the_tenants_share(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "one.png").write_bytes(b"x" * (1 << 20))
    c = await fake_router(
        ckpt, max_message_mb=2, requests_in_flight_mb=8, http_media_dir=str(tmp_path)
    )
    await add_workers(c)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {CLIENT_KEY}\r\nContent-Length: {2 << 20}\r\n\r\n"
    )
    part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/one.png"}}
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": [part, part]}]}
    url = f"{url_of(c)}/v1/chat/completions"
    stalled = socket.create_connection(host_port(c))  # half of tenant-a's 4 MiB
    try:
        stalled.sendall(head.encode())
        held = c.router.servicer.held
        await until(lambda: held.by_tenant == {"tenant-a": 2 << 20})
        # Its body is small; the file it names twice takes it past its share at the second.
        status, _, reply = await asyncio.to_thread(call, url, body, CLIENT_KEY)
        assert status == 429 and "tenant_share" in str(reply), reply
        assert held.by_tenant == {"tenant-a": 2 << 20}  # what it read given back
    finally:
        stalled.close()
        await c.close()
