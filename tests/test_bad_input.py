"""Bad requests at both front doors: each is refused before any worker is called, with an
error naming the field as the caller spells it (HTTP: a 400, or 413 for an oversized body,
never a 500; gRPC: INVALID_ARGUMENT with `epd-field`), and the router keeps answering.

Found by sending malformed requests to a deployment. Before, over HTTP: a `max_tokens` past
uint32, a `top_k` past int32 or a lone surrogate failed when the protobuf message was built
(500); a part missing its `url` was reported as `content.str: Input should be a valid
string`; an image error named the gRPC field (`image.data`); `logprobs` and tools were
silently ignored; a chunked body over the limit got FastAPI's own error shape. Over gRPC:
a resume token outside the vocab and an empty `prompt` were refused only by a worker, after
prefill ran; `fps = inf` was taken; a media `uuid` and a `request_id` had no length bound,
and every block key of an item hashes its uuid (1 MiB of uuid: 1.4 s of hashing an 8k-token
prompt, in the router and again in prefill and decode).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pydantic
import pytest
from PIL import Image

from common.errors import FieldError
from common.server.credentials import bearer_metadata
from epd.v1 import router_service_pb2, sampling_pb2
from router.http.convert import chat_request, completion_request
from router.http.errors import ApiError, http_field, validation_error
from router.http.media import MediaPolicy
from router.http.schema import ChatCompletionRequest, CompletionRequest
from router.inputs import InputError, decode_image
from router.settings import RouterSettings
from tests.cluster import CLIENT_KEY
from tests.test_http_api import WEATHER, add_workers, call, fake_router, url_of, user
from tests.test_router import Cluster as FakeCluster
from tests.test_router import FakeDecode, FakePrefill

Fakes = tuple[FakeCluster, FakePrefill, FakeDecode]  # a router with HTTP, its fake workers

MODEL = "tiny"
TEXT_PART = {"type": "text", "text": "hi"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": WEATHER, **extra}


def png_url(width: int, height: int, format: str = "PNG") -> str:
    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format=format)
    return f"data:image/{format.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def refusal(body: dict[str, Any]) -> ApiError:
    """What the API answers a body its schema refuses."""
    with pytest.raises(pydantic.ValidationError) as err:
        ChatCompletionRequest.model_validate(body)
    # FastAPI's locations start with "body"; pydantic's own do not.
    return validation_error([{**e, "loc": ("body", *e["loc"])} for e in err.value.errors()])


def parts(*content: dict[str, Any]) -> dict[str, Any]:
    """A chat body of one user message of these parts."""
    return chat(messages=user(*content))


C0, C1 = "messages[0].content[0]", "messages[0].content[1]"
VIDEO = {"type": "video_url", "video_url": {"url": "x"}, "fps": 0}
LONE = {"type": "image_url", "image_url": {"url": "\ud800"}}

# Body -> (param, a piece of the message).
SCHEMA_CASES: list[tuple[dict[str, Any], str, str]] = [
    (chat(max_tokens=1 << 32), "max_tokens", "4294967295"),
    (chat(max_completion_tokens=1 << 40), "max_completion_tokens", "4294967295"),
    (chat(top_k=1 << 40), "top_k", "2147483647"),
    (chat(temperature=1e300), "temperature", "less than or equal"),
    (chat(stop=["\udc00"]), "stop[0]", "lone surrogate"),
    (chat(stop=5), "stop", "valid string or"),
    (chat(messages=[{"role": "user", "content": "\ud800"}]), "messages[0].content", "UTF-8"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "valid list"),
    (parts({"type": "text", "text": "a\ud800"}), f"{C0}.text", "surrogate"),
    (parts({"type": "image_url", "image_url": {}}), f"{C0}.image_url.url", "required"),
    (parts({"type": "text"}), f"{C0}.text", "required"),
    (parts(VIDEO), f"{C0}.fps", "greater than 0"),
    (parts({"type": "audio", "audio": "x"}), C0, "'audio'"),
    (parts(TEXT_PART, LONE), f"{C1}.image_url.url", "UTF-8"),
]


@pytest.mark.parametrize(("body", "param", "says"), SCHEMA_CASES)
def test_a_body_the_schema_refuses_names_its_field(
    body: dict[str, Any], param: str, says: str
) -> None:
    error = refusal(body)
    assert (error.status, error.param) == (400, param), str(error)
    assert says in str(error) and str(error).startswith(f"{param}: ")
    assert error.param is not None and ".str" not in error.param


def test_invalid_json_is_named_as_such() -> None:
    json_error = {
        "type": "json_invalid",
        "loc": ("body", 7),
        "msg": "JSON decode error",
        "ctx": {"error": "Expecting value"},
    }
    error = validation_error([json_error])
    assert (error.status, error.param) == (400, None)
    assert str(error) == "the body is not valid JSON: Expecting value (at character 7)"


def test_the_widest_values_the_wire_carries_are_accepted() -> None:
    body = ChatCompletionRequest.model_validate(chat(max_tokens=(1 << 32) - 1, top_k=(1 << 31) - 1))
    request = chat_request(body, "r", MediaPolicy())
    assert (request.sampling.max_tokens, request.sampling.top_k) == ((1 << 32) - 1, (1 << 31) - 1)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_the_server_does_not_do_is_refused_not_ignored(
    extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(FieldError) as err:
        chat_request(ChatCompletionRequest.model_validate(chat(**extra)), "r", MediaPolicy())
    assert err.value.field == param
    allowed = chat(
        logprobs=False,
        tools=[],
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
    )
    assert chat_request(ChatCompletionRequest.model_validate(allowed), "r", MediaPolicy())
    for field, value in (("echo", True), ("best_of", 2), ("logprobs", 2)):
        body = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", field: value})
        with pytest.raises(FieldError) as err:
            completion_request(body, "r")
        assert err.value.field == field


def test_grpc_field_names_become_the_bodys() -> None:
    assert http_field("messages[2].content[1].image.data") == "messages[2].content[1].image_url.url"
    assert http_field("messages[0].content[0].video.file") == "messages[0].content[0].video_url.url"
    assert http_field("messages[0].content[3].video.fps") == "messages[0].content[3].fps"
    assert http_field("sampling.max_tokens") == "max_tokens"
    assert http_field("stop") == "stop"
    error = ApiError.from_router(
        __import__("grpc").StatusCode.INVALID_ARGUMENT,
        "messages[0].content[0].image.data: is not a decodable image",
        (("epd-field", "messages[0].content[0].image.data"),),
    )
    assert error.param == "messages[0].content[0].image_url.url"
    assert str(error) == "messages[0].content[0].image_url.url: is not a decodable image"


def test_only_the_configured_image_formats_are_opened() -> None:
    """`[router] image_formats`: an image in another format is refused by its first bytes,
    naming its field; one an operator adds is decoded."""
    data = base64.b64decode(png_url(8, 8, "TIFF").partition(",")[2])
    field = "messages[0].content[0].image.data"
    limits = RouterSettings(model="m").input_limits(1024)
    with pytest.raises(InputError, match="image_formats") as err:
        decode_image(data, field, limits)
    assert err.value.field == field
    tiff = RouterSettings(model="m", image_formats=("png", "tiff")).input_limits(1024)
    assert tiff.image_formats == ("PNG", "TIFF")  # any case, as PIL names them
    assert decode_image(data, field, tiff).size == (8, 8)
    for name in ("PNG", "JPEG", "WEBP", "GIF", "BMP"):  # what clients send, by default
        picture = base64.b64decode(png_url(8, 8, name).partition(",")[2])
        assert decode_image(picture, field, limits).size == (8, 8)


def test_a_tiff_whose_strip_offsets_are_fractions_is_not_a_decodable_image() -> None:
    """Found by decoding mutated files: PIL raised TypeError for it, which the router's
    decode errors did not include."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "TIFF")
    data = bytearray(buf.getvalue())
    order = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack(order + "I", data[4:8])
    (count,) = struct.unpack(order + "H", data[ifd : ifd + 2])
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        if struct.unpack(order + "H", data[entry : entry + 2]) == (273,):  # StripOffsets
            data[entry + 2 : entry + 4] = struct.pack(order + "H", 5)  # type RATIONAL
    with pytest.raises(InputError, match="is not a decodable image") as err:
        decode_image(bytes(data), "messages[0].content[0].image.data")
    assert err.value.field == "messages[0].content[0].image.data"


# ------------------------------------------------------------- a router with fake workers


@pytest.fixture
async def small_bodies(ckpt: Path) -> AsyncIterator[Fakes]:
    """A router taking bodies of at most 1 MiB (`max_message_mb`), holding at most 1 MiB of
    them at once (`requests_in_flight_mb`; any tenant all of it), and its fake workers."""
    c = await fake_router(ckpt, max_message_mb=1, requests_in_flight_mb=1, tenant_share=1.0)
    yield (c, *await add_workers(c))
    await c.close()


NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"hello").decode()
LONE_SURROGATE_BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'


def post_raw(url: str, data: bytes, *, chunked: bool = False) -> tuple[int, dict[str, Any]]:
    """POST `data` to the chat endpoint (as one body, or in 64 KiB chunks without a
    Content-Length); the status and JSON body."""
    host = url.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=30)
    headers = {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"}
    try:
        if chunked:
            pieces = (data[i : i + (1 << 16)] for i in range(0, len(data), 1 << 16))
            conn.request("POST", "/v1/chat/completions", pieces, headers, encode_chunked=True)
        else:
            conn.request("POST", "/v1/chat/completions", data, headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


async def test_the_router_answers_400_naming_the_field_and_keeps_serving(
    small_bodies: Fakes,
) -> None:
    url = url_of(small_bodies[0])
    endpoint = f"{url}/v1/chat/completions"
    cases: list[tuple[dict[str, Any] | bytes, str | None]] = [
        (chat(max_tokens=10**12), "max_tokens"),
        (chat(top_k=1 << 40), "top_k"),
        (chat(temperature=1e300), "temperature"),
        (chat(logprobs=True), "logprobs"),
        (parts(image(NOT_AN_IMAGE)), f"{C0}.image_url.url"),
        (parts(image(png_url(5000, 2)), TEXT_PART), f"{C0}.image_url.url"),
        (parts(image(png_url(8, 8, "TIFF")), TEXT_PART), f"{C0}.image_url.url"),
        (LONE_SURROGATE_BODY, "messages[0].content"),
        (b'{"model": "tiny", "messages": [', None),
    ]
    for body, param in cases:
        if isinstance(body, bytes):
            status, reply = await asyncio.to_thread(post_raw, url, body)
        else:
            status, _, reply = await asyncio.to_thread(call, endpoint, body, CLIENT_KEY)
        assert (status, reply["error"]["param"]) == (400, param), (body, reply)
        assert reply["error"]["type"] == "invalid_request_error"
    aspect = await asyncio.to_thread(call, endpoint, parts(image(png_url(5000, 2))), CLIENT_KEY)
    assert "aspect ratio" in aspect[2]["error"]["message"]
    not_image = await asyncio.to_thread(call, endpoint, parts(image(NOT_AN_IMAGE)), CLIENT_KEY)
    assert "object at 0x" not in not_image[2]["error"]["message"]  # no Python reprs
    tiff = await asyncio.to_thread(call, endpoint, parts(image(png_url(8, 8, "TIFF"))), CLIENT_KEY)
    assert tiff[2]["error"]["message"].endswith(
        "is not an image in a format this server decodes (PNG, JPEG, WEBP, GIF, BMP: "
        "[router] image_formats)"
    )
    status, _, reply = await asyncio.to_thread(call, endpoint, chat(max_tokens=2), CLIENT_KEY)
    assert status == 200 and reply["choices"][0]["message"]["content"] is not None


async def test_a_body_over_the_limit_is_413_with_or_without_its_length(
    small_bodies: Fakes,
) -> None:
    url = url_of(small_bodies[0])
    big = json.dumps(chat(messages=user({"type": "text", "text": "x" * (2 << 20)}))).encode()
    for chunked in (False, True):
        status, reply = await asyncio.to_thread(post_raw, url, big, chunked=chunked)
        assert status == 413, (chunked, reply)
        assert "body over" in reply["error"]["message"]
    small = json.dumps(chat(max_tokens=2)).encode()
    assert (await asyncio.to_thread(post_raw, url, small, chunked=True))[0] == 200


async def test_bodies_held_at_once_are_bounded(small_bodies: Fakes) -> None:
    """A client that sends half its body and stalls holds that much; a second large body
    that would pass the bound waits its turn (429, Retry-After); small ones still pass, and
    the large one does once the first client has gone."""
    url = url_of(small_bodies[0])
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stalled = socket.create_connection((host, int(port)))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        f"Authorization: Bearer {CLIENT_KEY}\r\nContent-Type: application/json\r\n\r\n"
    )
    piece = b" " * (600 << 10)
    stalled.sendall(head.encode() + f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    large = json.dumps(chat(max_tokens=2, user="x" * (700 << 10))).encode()
    small = json.dumps(chat(max_tokens=2)).encode()
    try:
        # The router reads the stalled client's bytes meanwhile (this event loop runs it):
        # a large body sent before that would be taken, and the stalled one refused.
        await asyncio.sleep(1.0)
        status, reply = await asyncio.to_thread(post_raw, url, large)
        assert status == 429, reply
        assert reply["error"]["type"] == "rate_limit_error"
        assert (await asyncio.to_thread(post_raw, url, small))[0] == 200
    finally:
        stalled.close()
    for _ in range(100):
        status, reply = await asyncio.to_thread(post_raw, url, large)
        if status != 429:
            break
        await asyncio.sleep(0.05)
    assert status == 200, reply


async def test_a_body_without_a_key_is_refused_before_it_is_read(small_bodies: Fakes) -> None:
    """401 as soon as the headers are in, the body unread: anonymous callers cannot hold
    the router's body budget (the large body after it is taken)."""
    url = url_of(small_bodies[0])
    host, port = url.removeprefix("http://").rsplit(":", 1)
    anonymous = socket.create_connection((host, int(port)), timeout=10)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        "Content-Type: application/json\r\n\r\n"
    )
    piece = b" " * (600 << 10)
    try:
        anonymous.sendall(head.encode() + f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        reply = await asyncio.to_thread(anonymous.recv, 4096)  # the body was never finished
        assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
        large = json.dumps(chat(max_tokens=2, user="x" * (700 << 10))).encode()
        assert (await asyncio.to_thread(post_raw, url, large))[0] == 200
    finally:
        anonymous.close()


def grpc_request(**fields: Any) -> router_service_pb2.GenerateRequest:
    request = router_service_pb2.GenerateRequest(
        messages=[router_service_pb2.ChatMessage(role="user")],
        sampling=sampling_pb2.SamplingParams(max_tokens=4),
    )
    request.MergeFrom(router_service_pb2.GenerateRequest(**fields))
    return request


def grpc_part(**content: Any) -> router_service_pb2.GenerateRequest:
    """A request whose one user message holds this part, then some text."""
    request = grpc_request()
    request.messages[0].content.add(**content)
    request.messages[0].content.add(text="hi")
    return request


PNG = base64.b64decode(png_url(32, 32).partition(",")[2])
GRPC_CASES: list[tuple[router_service_pb2.GenerateRequest, str]] = [
    (grpc_request(resume_tokens=[10**6]), "resume_tokens"),
    (grpc_request(prompt="", messages=[]), "prompt"),
    (grpc_request(request_id="r" * 257), "request_id"),
    (grpc_request(cache_salt="s" * 257), "cache_salt"),
    (
        grpc_part(image=router_service_pb2.ImageInput(data=PNG, uuid="u" * 257)),
        "messages[0].content[0].image.uuid",
    ),
    (
        grpc_part(video=router_service_pb2.VideoInput(frames=[PNG] * 2, fps=float("inf"))),
        "messages[0].content[0].video.fps",
    ),
]


async def test_grpc_requests_the_wire_carries_but_the_router_refuses(
    small_bodies: Fakes,
) -> None:
    router, prefill, decode = small_bodies
    stub = router.client._router
    for request, field in GRPC_CASES:
        call = stub.Generate(request, metadata=bearer_metadata(CLIENT_KEY))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert dict(err.value.trailing_metadata() or ())["epd-field"] == field
        assert (err.value.details() or "").startswith(f"{field}: ")
    assert prefill.requests == [] and decode.requests == []  # refused before any worker
    ok = grpc_request(request_id="r" * 256, resume_tokens=[5])
    ok.messages[0].content.add(text="hi")
    # At the bounds it is served: the tokens after the resumed one, to the finish.
    chunks = [c async for c in stub.Generate(ok, metadata=bearer_metadata(CLIENT_KEY))]
    assert sum(len(c.token_ids) for c in chunks) > 0 and chunks[-1].finish_reason
