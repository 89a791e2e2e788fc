"""A chat that sets no length (`max_tokens` nor `max_completion_tokens`) over the HTTP API:
it runs to the context it has, as OpenAI's does, but not past what the largest decode
worker's KV pool holds beside its prompt; a prompt that leaves no room is refused naming
the field it came in. A router with fake workers (`tests.test_http_api`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from common.models.tiny import make_tiny_checkpoint
from tests.test_http_api import MODEL_ID, WEATHER, add_workers, fake_router, url_of
from tests.test_http_openai_compat import CONTEXT, event_data, post


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


async def test_a_chat_without_a_length_runs_to_the_context_it_has(ckpt: Path) -> None:
    # OpenAI's chat runs to the end of the context when no length is set; it stopped at 16
    # tokens here, and a prompt near the end of the context was refused for a max_tokens
    # of 16 the client never sent. A completion's default stays OpenAI's 16.
    c = await fake_router(ckpt, max_model_len=CONTEXT, chat_max_tokens=40)
    try:
        _, decode = await add_workers(c)
        short = {"model": MODEL_ID, "messages": WEATHER}
        status, reply = await post(c, "/v1/chat/completions", short)
        assert status == 200, reply
        assert decode.requests[-1].sampling.max_tokens == 40  # chat_max_tokens: it fits
        assert reply["usage"]["completion_tokens"] == 40
        assert reply["choices"][0]["finish_reason"] == "length"
        long = {"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * 40}]}
        status, reply = await post(c, "/v1/chat/completions", long)
        assert status == 200, reply
        prompt = reply["usage"]["prompt_tokens"]
        assert CONTEXT - prompt < 40
        assert reply["usage"]["completion_tokens"] == CONTEXT - prompt  # what is left
        # A length the client set is still checked against the context, never cut.
        status, reply = await post(c, "/v1/chat/completions", long | {"max_tokens": 40})
        assert (status, reply["error"]["code"]) == (400, "context_length_exceeded")
        status, reply = await post(c, "/v1/completions", {"model": MODEL_ID, "prompt": "Hi"})
        assert status == 200 and reply["usage"]["completion_tokens"] == 16, reply
        # Nor past what the largest decode worker holds: it was refused for needing more
        # KV blocks "for max_tokens 40", which the client never sent.
        from common.roles import Role
        from router.workers import WorkerLoad

        registry = c.router.registry
        assert registry.reference_layout is not None
        block = registry.reference_layout.block_size
        for worker in registry.workers(Role.DECODE):
            worker.load = WorkerLoad(kv_blocks_free=2)
        status, reply = await post(c, "/v1/chat/completions", short)
        assert status == 200, reply
        prompt = reply["usage"]["prompt_tokens"]
        assert decode.requests[-1].sampling.max_tokens == 2 * block - prompt + 1 < 40
        # A prompt that leaves decode no room is refused naming the field it came in, and
        # no length: it named `messages` and the default for a completion's `prompt`.
        body = {"model": MODEL_ID, "prompt": "word " * 2 * block}
        status, reply = await post(c, "/v1/completions", body)
        assert (status, reply["error"]["param"]) == (400, "prompt"), reply
        assert "max_tokens" not in reply["error"]["message"], reply
        # A completion's default (16, OpenAI's) is not cut, and its refusal says it is a
        # default: it read "max_tokens 16", which the client never sent (s38diff review).
        for words in range(2 * block, 0, -1):  # a prompt leaving decode 2-14 tokens of room
            body = {"model": MODEL_ID, "prompt": "word " * words}
            status, reply = await post(c, "/v1/completions", body | {"max_tokens": 1})
            if status == 200 and 2 <= 2 * block - reply["usage"]["prompt_tokens"] < 15:
                break
        status, reply = await post(c, "/v1/completions", body)
        assert (status, reply["error"]["param"]) == (400, "max_tokens"), reply
        assert "max_tokens 16 (the default: the request set none)" in reply["error"]["message"]
    finally:
        await c.close()


async def test_a_default_length_a_decode_workers_own_refusal_names_says_it_is_one(
    ckpt: Path,
) -> None:
    # Before a decode worker has heartbeated its pool, the default is not cut to it and the
    # worker refuses the chat itself; reworded as admission would, that named "max_tokens
    # 40", which the client never sent (ownfixD review).
    from common.roles import Role
    from tests.test_admission_router import WholePoolDecode
    from tests.test_router import FakeEncoder, FakePrefill

    c = await fake_router(ckpt, chat_max_tokens=40)
    try:
        await c.add(Role.ENCODER, FakeEncoder())
        await c.add(Role.PREFILL, FakePrefill())
        await c.add(Role.DECODE, WholePoolDecode(2))  # 2 blocks: the prompt and a few tokens
        status, reply = await post(
            c, "/v1/chat/completions", {"model": MODEL_ID, "messages": WEATHER}
        )
        assert (status, reply["error"]["param"]) == (400, "max_tokens"), reply
        assert "max_tokens 40 (the default: the request set none)" in reply["error"]["message"]
        # Named as the body spells it, after the first chunk too (it was `max_tokens` for a
        # body that sent `max_completion_tokens`: ownfixE review), streamed or not.
        sent = {"model": MODEL_ID, "messages": WEATHER, "max_completion_tokens": 40}
        status, reply = await post(c, "/v1/chat/completions", sent)
        assert (status, reply["error"]["param"]) == (400, "max_completion_tokens"), reply
        assert "max_completion_tokens 40;" in reply["error"]["message"], reply
        _, data = await asyncio.to_thread(event_data, url_of(c), sent | {"stream": True})
        last = json.loads(data[-1])  # an error ends the stream (no `[DONE]`)
        assert last["error"]["param"] == "max_completion_tokens", last
    finally:
        await c.close()
