"""The router's preparation threads (`router.prepare_threads`): requests with media run on
their own pool, where one tenant has at most its `tenant_share` of the threads; text-only
requests never wait behind them. On asyncio's default executor, eight slow videos of one
tenant made a one-token text request of another wait 84 s."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

import router.server
from common.server.credentials import bearer_metadata
from router.prepare_threads import PrepareThreads, has_media
from tests.cluster import CLIENT_KEY, OTHER_KEY
from tests.test_bad_input import grpc_request, png_url
from tests.test_http_api import MODEL_ID, add_workers, call, fake_router, url_of
from tests.test_tenant_share import until


def blocking(gate: threading.Event, started: list[str]) -> Any:
    def work(name: str) -> str:
        started.append(name)
        assert gate.wait(10)
        return name

    return work


@pytest.mark.parametrize("heavy", [True, False])
async def test_a_tenant_runs_at_most_its_share_of_each_pool(heavy: bool) -> None:
    # Media threads; and text threads too: a tenant's 32 text prompts of 1 MiB (0.6-2 s
    # each to tokenize) held a one-token prompt of another 30 s when only media were shared.
    threads = PrepareThreads(tenant_share=0.5, threads=4)  # 2 of 4 threads in each pool
    pool = "heavy" if heavy else "light"
    gate, started = threading.Event(), list[str]()
    work = blocking(gate, started)
    try:
        a = [asyncio.ensure_future(threads.run(heavy, "a", work, f"a{i}")) for i in range(3)]
        await until(lambda: len(started) == 2)
        await asyncio.sleep(0.05)
        assert sorted(started) == ["a0", "a1"] and threads.busy("a", pool) == 2  # a2 waits
        b = asyncio.ensure_future(threads.run(heavy, "b", work, "b0"))
        other = await threads.run(not heavy, "a", lambda: "other")  # the other pool: free
        assert other == "other"
        await until(lambda: "b0" in started)  # another tenant: the next free thread
        gate.set()
        assert await asyncio.gather(*a, b) == ["a0", "a1", "a2", "b0"]
        assert threads._of == {}  # forgotten with their last work
    finally:
        gate.set()
        await threads.close()


async def test_a_share_is_held_until_the_work_ends_though_its_caller_left() -> None:
    # A client that hangs up and sends again would otherwise get a thread more each time.
    threads = PrepareThreads(tenant_share=0.25, threads=4)  # one thread a tenant
    gate, started = threading.Event(), list[str]()
    work = blocking(gate, started)
    try:
        first = asyncio.ensure_future(threads.run(True, "a", work, "a0"))
        await until(lambda: started == ["a0"])
        first.cancel()
        second = asyncio.ensure_future(threads.run(True, "a", work, "a1"))
        await asyncio.sleep(0.1)
        assert started == ["a0"] and threads.busy("a") == 1  # a0 runs on: a1 waits
        gate.set()
        assert await second == "a1"
        assert threads._of == {}
    finally:
        gate.set()
        await threads.close()


def test_has_media() -> None:
    request = grpc_request()
    assert not has_media(request)
    request.messages[0].content.add(image={"data": b"x"})
    assert has_media(request)


@pytest.fixture
async def slow_media(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A router with two tenants whose preparation of any request with media waits for
    `gate` (as a long video decode would): the router and the gate."""
    gate = threading.Event()
    prepare = router.server.prepare_request

    def slow(settings: Any, processor: Any, request: Any, *args: Any) -> Any:
        if has_media(request):
            assert gate.wait(20)
        return prepare(settings, processor, request, *args)

    monkeypatch.setattr(router.server, "prepare_request", slow)
    c = await fake_router(ckpt)
    await add_workers(c)
    try:
        yield c, gate
    finally:
        gate.set()
        await c.close()


async def test_a_tenants_slow_media_leave_other_requests_their_threads(slow_media: Any) -> None:
    c, gate = slow_media
    threads = c.router.servicer.prepare_threads
    url = f"{url_of(c)}/v1/chat/completions"

    def chat(key: str, image: bool) -> int:
        content: list[dict[str, Any]] = [{"type": "text", "text": "hi"}]
        if image:
            content.insert(0, {"type": "image_url", "image_url": {"url": png_url(32, 32)}})
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}]}
        return call(url, body | {"max_tokens": 2}, key)[0]

    # The clients' own threads: this event loop's default executor is the router's too.
    clients = ThreadPoolExecutor(12)
    loop = asyncio.get_running_loop()

    def send(key: str, image: bool) -> asyncio.Future[int]:
        return loop.run_in_executor(clients, chat, key, image)

    # Tenant a fills the pool with more media requests than it has threads.
    slow = [send(CLIENT_KEY, True) for _ in range(8)]
    await until(lambda: threads.busy("tenant-a") == threads.shares["heavy"], 10)
    await until(lambda: threads.pending["heavy"] == 8, 10)  # its others wait for its share
    page = generate_latest(c.router.orchestrator.metrics.registry).decode()
    assert 'epd:prepare_pending{pool="heavy"} 8.0' in page
    # Text requests of either tenant, over HTTP and gRPC, are served meanwhile.
    assert await asyncio.wait_for(send(OTHER_KEY, False), 10) == 200
    assert await asyncio.wait_for(send(CLIENT_KEY, False), 10) == 200
    request = grpc_request(request_id="b")
    request.messages[0].content.add(text="hi")
    answer = c.client._router.Generate(request, metadata=bearer_metadata(OTHER_KEY))
    assert (await asyncio.wait_for(answer.read(), 10)).token_ids
    answer.cancel()
    # Tenant b's own media request waits for no one of tenant a's: it takes a free thread.
    b_media = send(OTHER_KEY, True)
    await until(lambda: threads.busy("tenant-b") == 1, 10)
    gate.set()
    assert await asyncio.wait_for(b_media, 20) == 200
    assert await asyncio.wait_for(asyncio.gather(*slow), 30) == [200] * 8
    clients.shutdown()
