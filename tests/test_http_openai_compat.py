"""Where the HTTP API must answer as OpenAI's does, for clients written against it: `null`
for an optional field means unset, `GET /v1/models/{model}` exists, and the error codes
clients branch on (`model_not_found`, `context_length_exceeded`) are OpenAI's.

A router with fake workers (`tests.test_http_api`), driven by raw JSON where the `openai`
client would not send the body under test, and by the client elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio

from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import GenerateError
from tests.cluster import CLIENT_KEY
from tests.test_http_api import (
    MODEL_ID,
    WEATHER,
    add_workers,
    api,
    call,
    fake_router,
    png_data_url,
    url_of,
)
from tests.test_router import Cluster as FakeCluster

CONTEXT = 64  # the router's max_model_len here: small, so a prompt can overrun it

# One router for the module's tests that only send requests (`fake`), on one event loop.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fake(ckpt: Path) -> AsyncIterator[FakeCluster]:
    c = await fake_router(ckpt, max_queued_requests=0, max_model_len=CONTEXT)
    await add_workers(c)
    yield c
    await c.close()


def event_data(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """POST a streamed chat (blocking): the status and every event's data, as sent."""
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST"
    )
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {CLIENT_KEY}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    return reply.status, [
        line.removeprefix("data: ") for line in lines if line.startswith("data: ")
    ]


def events(url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """POST a streamed chat (blocking): the status and the events' JSON, up to `[DONE]`."""
    status, data = event_data(url, body)
    assert data[-1] == "[DONE]", data
    return status, [json.loads(event) for event in data[:-1]]


async def post(c: FakeCluster, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, reply = await asyncio.to_thread(call, f"{url_of(c)}{path}", body, CLIENT_KEY)
    return status, reply


@pytest.mark.parametrize(
    "extra",
    [
        {"n": None},
        {"stream": None},
        {"stream": True, "stream_options": {"include_usage": None}},
        {"stream_options": None},
        {"ignore_eos": None},
        {"temperature": None, "top_p": None, "stop": None, "seed": None, "user": None},
    ],
)
async def test_null_means_unset(fake: FakeCluster, extra: dict[str, Any]) -> None:
    body = {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 3} | extra
    if extra.get("stream"):  # an event stream, not JSON
        status, chunks = await asyncio.to_thread(events, url_of(fake), body)
        assert status == 200 and chunks
        assert all(chunk.get("usage") is None for chunk in chunks)  # include_usage unset
        return
    status, reply = await post(fake, "/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["object"] == "chat.completion" and len(reply["choices"]) == 1


async def test_null_means_unset_in_completions(fake: FakeCluster) -> None:
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 3, "echo": None, "n": None}
    status, reply = await post(fake, "/v1/completions", body)
    assert status == 200, reply
    assert reply["object"] == "text_completion"


async def test_the_client_may_send_none(fake: FakeCluster) -> None:
    reply = await api(url_of(fake)).chat.completions.create(
        model=MODEL_ID,
        messages=WEATHER,
        max_tokens=3,
        n=None,
        stream=None,
    )
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": "two"}, "n"),
        ({"stream": "maybe"}, "stream"),
        ({"ignore_eos": [1]}, "ignore_eos"),
        ({"stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
        ({"messages": None}, "messages"),  # required: null is no default
        ({"model": None}, "model"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
    ],
)
async def test_wrong_types_are_still_refused(
    fake: FakeCluster, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL_ID, "messages": WEATHER} | extra
    status, reply = await post(fake, "/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert reply["error"]["message"].startswith(param), reply
    if param == "cache_salt":  # a string's bound, not pydantic's "items" of a sequence
        assert "character" in reply["error"]["message"], reply


async def test_the_served_model_can_be_retrieved(fake: FakeCluster) -> None:
    client = api(url_of(fake))
    listed = (await client.models.list()).data
    assert [m.id for m in listed] == [MODEL_ID]
    assert await client.models.retrieve(MODEL_ID) == listed[0]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("gpt-4o")
    error = missing.value.body
    assert error == {  # the client unwraps {"error": ...}
        "message": "the model 'gpt-4o' does not exist (this server serves 'tiny')",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    with pytest.raises(openai.AuthenticationError):  # the list's auth
        await api(url_of(fake), "not-a-key").models.retrieve(MODEL_ID)


async def test_a_served_name_with_a_slash_can_be_retrieved(ckpt: Path) -> None:
    c = await fake_router(ckpt, served_model_name="org/tiny")
    try:
        client = api(url_of(c))
        assert (await client.models.retrieve("org/tiny")).id == "org/tiny"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("org/other")
    finally:
        await c.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_an_unknown_model_is_model_not_found(fake: FakeCluster, path: str) -> None:
    body = {"model": "gpt-4o", "messages": WEATHER, "prompt": "Hello"}
    status, reply = await post(fake, path, body)
    assert status == 404
    assert reply["error"] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


@pytest.mark.parametrize(
    ("messages", "max_tokens", "param"),
    [
        (WEATHER, CONTEXT, "max_tokens"),  # the prompt takes some of the context
        (WEATHER, CONTEXT, "max_completion_tokens"),  # named as the body named it
        ([{"role": "user", "content": "word " * CONTEXT}], 3, "messages"),
    ],
)
async def test_past_the_context_is_context_length_exceeded(
    fake: FakeCluster, messages: list[Any], max_tokens: int, param: str
) -> None:
    length = "max_completion_tokens" if param == "max_completion_tokens" else "max_tokens"
    body = {"model": MODEL_ID, "messages": messages, length: max_tokens}
    status, reply = await post(fake, "/v1/chat/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        param,
        "context_length_exceeded",
    ), error
    assert "context" in error["message"]
    if param == "max_completion_tokens":  # the name the body used, throughout
        assert "max_tokens" not in error["message"].replace("max_completion_tokens", ""), error
    # Other refusals keep their code; gRPC keeps INVALID_ARGUMENT for this one.
    status, reply = await post(fake, "/v1/chat/completions", body | {"temperature": -1})
    assert (status, reply["error"]["code"]) == (400, "invalid_argument")
    with pytest.raises(GenerateError) as err:
        await fake.client.generate_text(messages, SamplingParams(max_tokens=max_tokens))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"min_p": 0.2}, "min_p"),
        ({"min_tokens": 4}, "min_tokens"),
        ({"bad_words": ["rain"]}, "bad_words"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        # These came back 200 with plain text (a review): a forced tool, audio out, guided
        # decoding, a different prompt than asked.
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
async def test_vllm_extensions_not_done_are_refused_not_ignored(
    fake: FakeCluster, extra: dict[str, Any], param: str
) -> None:
    # They were dropped as unknown fields: an answer without them looked like one with them.
    body = {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 3}
    status, reply = await post(fake, "/v1/chat/completions", body | extra)
    assert (status, reply["error"]["param"]) == (400, param), reply
    neutral = {
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "min_tokens": 0,
        "bad_words": [],
        "include_stop_str_in_output": False,
        "tool_choice": "auto",
        "function_call": "none",
        "modalities": ["text"],
        "audio": None,
        "prediction": None,
        "guided_json": None,
        "guided_choice": None,
        "structured_outputs": None,
        "continue_final_message": False,
        "add_generation_prompt": True,
        "prompt_logprobs": None,
        "use_beam_search": False,
    }
    status, reply = await post(fake, "/v1/chat/completions", body | {param: neutral[param]})
    assert status == 200, reply


async def test_stream_options_without_a_stream_is_refused(fake: FakeCluster) -> None:
    body = {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 3}
    options = {"stream_options": {"include_usage": True}}
    status, reply = await post(fake, "/v1/chat/completions", body | options)
    assert (status, reply["error"]["param"]) == (400, "stream_options"), reply


async def test_completion_fields_not_done_are_refused(fake: FakeCluster) -> None:
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 3}
    for extra, param in (({"suffix": "!"}, "suffix"), ({"logprobs": 0}, "logprobs")):
        status, reply = await post(fake, "/v1/completions", body | extra)
        assert (status, reply["error"]["param"]) == (400, param), reply


async def test_stop_token_ids_and_any_int64_seed_are_taken(ckpt: Path) -> None:
    c = await fake_router(ckpt, max_model_len=CONTEXT)
    try:
        _, decode = await add_workers(c)
        body = {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 3}
        status, reply = await post(c, "/v1/chat/completions", body | {"stop_token_ids": [7, 9]})
        assert status == 200, reply
        assert list(decode.requests[-1].sampling.stop_token_ids) == [7, 9]
        status, reply = await post(c, "/v1/chat/completions", body | {"seed": -1})
        assert status == 200 and not decode.requests[-1].sampling.HasField("seed")  # random
        status, reply = await post(c, "/v1/chat/completions", body | {"seed": -5})
        assert status == 200 and decode.requests[-1].sampling.seed == 2**63 - 5
        status, reply = await post(c, "/v1/chat/completions", body | {"seed": 2**63})
        assert (status, reply["error"]["param"]) == (400, "seed")
    finally:
        await c.close()


async def test_data_urls_in_any_case_and_wrapped_base64_are_read(fake: FakeCluster) -> None:
    url = png_data_url(3)
    header, payload = url.split(",", 1)
    wrapped = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    for form in (header.upper() + "," + payload, header + "," + wrapped):
        image = {"type": "image_url", "image_url": {"url": form}}
        messages = [{"role": "user", "content": [image, {"type": "text", "text": "what?"}]}]
        body = {"model": MODEL_ID, "messages": messages, "max_tokens": 3}
        status, reply = await post(fake, "/v1/chat/completions", body)
        assert status == 200, reply
    bad = {"type": "image_url", "image_url": {"url": header + ",not base64!"}}
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": [bad]}], "max_tokens": 3}
    status, reply = await post(fake, "/v1/chat/completions", body)
    assert status == 400 and "base64" in reply["error"]["message"], reply


async def test_unknown_paths_methods_and_non_json_bodies_answer_in_openai_shape(
    fake: FakeCluster,
) -> None:
    url = url_of(fake)
    status, _, reply = await asyncio.to_thread(call, f"{url}/v1/nothing", {"a": 1}, CLIENT_KEY)
    assert status == 404 and reply["error"]["type"] == "not_found_error", reply
    status, headers, reply = await asyncio.to_thread(
        call, f"{url}/v1/chat/completions", None, CLIENT_KEY
    )
    assert status == 405 and "error" in reply and "POST" in headers.get("allow", ""), reply

    def form() -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", data=b"model=x", method="POST"
        )
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        request.add_header("Authorization", f"Bearer {CLIENT_KEY}")
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, reply = await asyncio.to_thread(form)
    assert status == 400 and "application/json" in reply["error"]["message"], reply


async def test_top_p_0_keeps_the_likeliest_token_only(fake: FakeCluster) -> None:
    # OpenAI takes top_p 0; it was refused with FLOAT32_TINY spelled out in the message.
    from router.http.convert import sampling
    from router.http.schema import FLOAT32_TINY, ChatCompletionRequest

    for top_p in (0.0, 1e-46):  # 1e-46: 0 as a float32
        body = {"model": MODEL_ID, "messages": WEATHER, "top_p": top_p}
        assert sampling(ChatCompletionRequest.model_validate(body)).top_p == pytest.approx(
            FLOAT32_TINY
        )
    body = {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 3, "top_p": 0}
    status, reply = await post(fake, "/v1/chat/completions", body)
    assert status == 200, reply
