"""Admission's refusals over HTTP (`router.http.errors`): a full queue is 429 with
Retry-After, which clients retry; what waiting cannot cure (more KV blocks than any worker
has, more inline embedding bytes than the router carries) is 400 without it. With the fake
workers of `tests.test_http_api`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.processing.messages import messages_from_dicts
from common.roles import Role
from common.sampling import SamplingParams
from epd.client import GenerateError
from router.admission import Need
from router.workers import WorkerLoad
from tests import test_http_api
from tests.cluster import CLIENT_KEY
from tests.model_fixtures import user
from tests.test_http_api import (
    MODEL_ID,
    WEATHER,
    add_workers,
    call,
    fake_router,
    png_data_url,
    url_of,
)
from tests.test_router import TEXT
from tests.test_router import Cluster as FakeCluster

fake = test_http_api.fake  # a router with fake workers in this event loop
ckpt = test_http_api.ckpt


async def test_a_full_queue_answers_429_with_retry_after(fake: FakeCluster) -> None:
    pre, _ = await add_workers(fake)
    prompt = fake.router.orchestrator.processor.process(messages_from_dicts(TEXT))
    need = Need(len(prompt.prompt_token_ids), 4, 16)
    for w in fake.router.registry.workers():  # room for one request at a time
        w.load = WorkerLoad(kv_blocks_free=need.blocks(Role.DECODE))
    pre.hang = True
    first = asyncio.create_task(fake.client.generate_text(TEXT, SamplingParams(max_tokens=4)))
    while not pre.requests:
        await asyncio.sleep(0.01)
    status, headers, reply = await asyncio.to_thread(
        call,
        f"{url_of(fake)}/v1/chat/completions",
        {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 4},
        CLIENT_KEY,
    )
    first.cancel()
    assert status == 429, reply
    assert int(headers["retry-after"]) >= 1
    assert reply["error"]["type"] == "rate_limit_error"
    assert reply["error"]["code"] == "rate_limit_exceeded"  # OpenAI's code


async def test_a_request_that_can_never_fit_is_400_not_429(ckpt: Path) -> None:
    """Refusals that waiting cannot cure (more KV blocks than any worker has; more inline
    embedding bytes than the router carries) are 400 invalid_request_error, which clients
    do not retry, without Retry-After; gRPC keeps RESOURCE_EXHAUSTED."""
    c = await fake_router(ckpt, max_inline_embedding_mb=0)
    try:
        await add_workers(c)
        endpoint = f"{url_of(c)}/v1/chat/completions"

        async def refusal(messages: list[Any], max_tokens: int, code: str) -> str:
            body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens}
            status, headers, reply = await asyncio.to_thread(call, endpoint, body, CLIENT_KEY)
            assert (status, reply["error"]["type"]) == (400, "invalid_request_error"), reply
            assert "retry-after" not in headers
            assert reply["error"]["code"] == code  # not rate_limit_exceeded: nothing to wait for
            return str(reply["error"]["message"])

        image = {"type": "image_url", "image_url": {"url": png_data_url(1)}}
        assert "inline embeddings" in await refusal(user(image), 4, "invalid_argument")
        for w in c.router.registry.workers():
            w.load = WorkerLoad(kv_blocks_free=4)  # 4 blocks of 16 tokens each
        assert "KV blocks" in await refusal(WEATHER, 200, "context_length_exceeded")
        with pytest.raises(GenerateError) as err:
            await c.client.generate_text(WEATHER, SamplingParams(max_tokens=200))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await c.close()
