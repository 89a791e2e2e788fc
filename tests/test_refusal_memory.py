"""A refused request is freed when its refusal is answered, without a garbage collection.

A refusal's traceback held frames that held the request (the handler that named the error,
the thread future that carried it, the gRPC handler gRPC keeps in a cycle with its abort):
reference cycles, which kept each refused request until a garbage collection, and a quiet
router may run none for long: four refused 250 MiB chat bodies left one at 789 MB (attacker2
review, s40). Measured with the collector off: what a second refusal leaves allocated."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from epd.v1 import router_service_pb2, router_service_pb2_grpc
from tests import test_http_api
from tests.cluster import CLIENT_KEY
from tests.test_http_api import MODEL_ID, raw_post, url_of
from tests.test_router import Cluster as FakeCluster

fake = test_http_api.fake  # a router with fake workers in this event loop
ckpt = test_http_api.ckpt


# What a refused request is made of, found in cycles: the bytes tracemalloc counts miss a
# parsed request (upb's memory is not Python's: ownfixC review C5).
REQUEST_TYPES = {"GenerateRequest", "Sized", "Job", "ProcessedPrompt", "ChatCompletionRequest"}


async def held_after(refuse: Callable[[], Awaitable[Any]]) -> tuple[Any, int]:
    """`refuse()`'s outcome, and the bytes still allocated after it with the collector off
    (a first call before: imports and first-use caches); no part of a request may be found
    in a cycle then."""
    await refuse()
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        outcome = await refuse()
        await asyncio.sleep(0.1)
        held = tracemalloc.get_traced_memory()[0] - before
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycles = {type(o).__name__ for o in gc.garbage} & REQUEST_TYPES
        assert not cycles, f"kept in reference cycles: {sorted(cycles)}"
        return outcome, held
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        tracemalloc.stop()
        gc.enable()
        gc.collect()


async def test_a_refused_http_body_is_freed(fake: FakeCluster) -> None:
    text = "a" * (4 << 20)  # past max_prompt_text_bytes (1 MiB)
    body = f'{{"model": "{MODEL_ID}", "messages": [{{"role": "user", "content": "{text}"}}]}}'
    url = f"{url_of(fake)}/v1/chat/completions"
    (status, _, answer), held = await held_after(
        lambda: asyncio.to_thread(raw_post, url, body.encode())
    )
    assert status == 400 and answer["error"]["param"] == "messages[0].content"
    assert held < 1 << 20, f"{held / 2**20:.1f} MiB held after the refusal"


@pytest.mark.parametrize(
    ("request_", "field"),
    [  # refused after parsing (an image that is none), and before (its text)
        ({"content": [{"image": {"data": b"x" * (8 << 20)}}]}, "messages[0].content[0].image.data"),
        ({"content": [{"text": "a" * (4 << 20)}]}, "messages[0].content[0].text"),
    ],
)
async def test_a_refused_generate_request_is_freed(
    fake: FakeCluster, request_: dict[str, Any], field: str
) -> None:
    request = router_service_pb2.GenerateRequest(messages=[{"role": "user", **request_}])
    metadata = (("authorization", f"Bearer {CLIENT_KEY}"),)
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(fake.router.address, options=options) as channel:
        stub = router_service_pb2_grpc.RouterServiceStub(channel)

        async def refuse() -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(request, metadata=metadata):
                    pass
            trailers = dict(err.value.trailing_metadata() or ())
            return err.value.code(), str(trailers.get("epd-field"))

        outcome, held = await held_after(refuse)
    assert outcome == (grpc.StatusCode.INVALID_ARGUMENT, field)
    assert held < 1 << 20, f"{held / 2**20:.1f} MiB held after the refusal"


async def test_an_http_chat_refused_while_its_media_are_read_is_freed(fake: FakeCluster) -> None:
    # Refused in the thread that reads its media (a data URL that is no base64, after a
    # large one): the task that carried the error closed a cycle (ownfixC review C1).
    image = "data:image/png;base64," + "A" * (4 << 20)
    parts = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
    ]
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": parts}]})
    url = f"{url_of(fake)}/v1/chat/completions"
    (status, _, answer), held = await held_after(
        lambda: asyncio.to_thread(raw_post, url, body.encode())
    )
    assert status == 400 and answer["error"]["param"] == "messages[0].content[1].image_url.url"
    assert held < 1 << 20, f"{held / 2**20:.1f} MiB held after the refusal"


async def test_a_stream_whose_client_left_is_freed(fake: FakeCluster) -> None:
    # The client of a streamed answer hung up mid-answer: anyio keeps the cancellation in a
    # cycle with the frames it passed, which held the request, its job, prompt and pixels,
    # and (through the stream's error handler) the parsed body (ownfixC C4, ownfixD D1).
    from tests.test_http_api import add_workers
    from tests.test_http_disconnect import send_then_hang_up

    _, decode = await add_workers(fake)
    decode.hang_after_first = True  # one token, then nothing: a long answer
    loop = asyncio.get_running_loop()

    async def leave() -> None:
        asked, answering = len(decode.requests), asyncio.Event()

        async def watch() -> None:
            while len(decode.requests) == asked:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # past its first chunk
            answering.set()

        watcher = asyncio.create_task(watch())
        await asyncio.to_thread(send_then_hang_up, url_of(fake), True, answering, loop)
        await watcher
        await asyncio.wait_for(decode.cancelled.wait(), 10)
        decode.cancelled.clear()
        await asyncio.sleep(0.2)  # the router's side of the stream ends

    await held_after(leave)  # no part of the request left in a cycle
