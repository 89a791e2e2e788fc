"""Bad requests at both front doors of a running router with fake workers (`tests.test_router`'s,
with the HTTP API of tests/test_http_api.py): each is refused before any worker is called,
with an error naming the field as the caller spells it (HTTP: a 400, or 413 for an oversized
body, never a 500; gRPC: INVALID_ARGUMENT with `epd-field`), and the router keeps answering.
The bodies a router holds at once are bounded (a large one past the bound waits: 429), and a
body without a key is refused (401) before it is read. The bodies and requests are built by
tests/test_bad_input.py's helpers, which also holds the history of these refusals.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.sampling import SamplingParams
from common.server.credentials import bearer_metadata
from epd.client import GenerateError
from epd.v1 import router_service_pb2
from tests.cluster import CLIENT_KEY
from tests.test_bad_input import (
    C0,
    TEXT_PART,
    VIDEO,
    chat,
    grpc_request,
    parts,
    png_url,
    post_raw,
)
from tests.test_http_api import add_workers, call, fake_router, url_of, user
from tests.test_http_connections import closed_within
from tests.test_router import TEXT, FakeDecode, FakePrefill
from tests.test_router import Cluster as FakeCluster

Fakes = tuple[FakeCluster, FakePrefill, FakeDecode]  # a router with HTTP, its fake workers


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture
async def small_bodies(ckpt: Path) -> AsyncIterator[Fakes]:
    """A router taking bodies of at most 1 MiB (`max_message_mb`), holding at most 1 MiB of
    them at once (`requests_in_flight_mb`; any tenant all of it), and its fake workers."""
    c = await fake_router(ckpt, max_message_mb=1, requests_in_flight_mb=1, tenant_share=1.0)
    yield (c, *await add_workers(c))
    await c.close()


NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"hello").decode()
LONE_SURROGATE_BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'


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
        (parts(image("http://[::1/cat.png"), TEXT_PART), f"{C0}.image_url.url"),  # unsplittable
        # Refused before the wire's float32 would make it 0 (the default) or infinite.
        (parts(VIDEO | {"video_url": {"url": NOT_AN_IMAGE}, "fps": 1e-300}), f"{C0}.fps"),
        (parts(VIDEO | {"video_url": {"url": NOT_AN_IMAGE}, "fps": 1e300}), f"{C0}.fps"),
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
        assert reply["error"]["message"].endswith(" bytes (max_message_mb)"), reply
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


async def test_a_body_on_any_method_but_post_is_refused_unread(small_bodies: Fakes) -> None:
    """405 and the connection closed as soon as the head is in, key or not: the body is
    neither read nor held, so sockets that announce one (and send nothing) cannot hold the
    router's body budget from the clients of either front door."""
    router = small_bodies[0]
    url = url_of(router)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    try:
        for method, key in (("PUT", ""), ("GET", ""), ("DELETE", CLIENT_KEY)):
            for framing in (f"Content-Length: {1 << 20}", "Transfer-Encoding: chunked"):
                sock = socket.create_connection((host, int(port)), timeout=10)
                socks.append(sock)
                auth = f"Authorization: Bearer {key}\r\n" if key else ""
                head = f"{method} /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}{framing}"
                sock.sendall(f"{head}\r\n\r\n".encode())
                told = await closed_within(sock, 5.0)
                assert told is not None and told.startswith(b"HTTP/1.1 405"), (method, told)
                assert b"only a POST request may carry a body" in told
        assert router.router.servicer.held.held == 0
        large = json.dumps(chat(max_tokens=2, user="x" * (700 << 10))).encode()
        assert (await asyncio.to_thread(post_raw, url, large))[0] == 200
        text = await router.client.generate_text(TEXT, SamplingParams(max_tokens=2))
        assert text.finish_reason == "length"
        assert (await asyncio.to_thread(call, f"{url}/health"))[0] == 200  # no body: served
    finally:
        for sock in socks:
            sock.close()


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
    # Logged by every process it reaches: a line break forged log lines.
    (grpc_request(request_id="x\n2030-01-01 INFO router.server: forged"), "request_id"),
    (grpc_request(cache_salt="s\x1b[2J"), "cache_salt"),
    (grpc_request(request_id="x\u2028forged"), "request_id"),
    (grpc_request(request_id="x\u202edegrof"), "request_id"),  # read right to left
    *(  # the wire's roles only: a template renders any string as one
        (grpc_request(messages=[router_service_pb2.ChatMessage(role=role)]), "messages[1].role")
        for role in ("", "bogus", "tool", "User")
    ),
    (
        grpc_part(image=router_service_pb2.ImageInput(data=PNG, uuid="u" * 257)),
        "messages[0].content[0].image.uuid",
    ),
    *(
        (
            grpc_part(video=router_service_pb2.VideoInput(frames=[PNG] * 2, fps=fps)),
            "messages[0].content[0].video.fps",
        )
        # The wire's fps is a float32: 1e-40 is one of its subnormals.
        for fps in (float("inf"), 1e-40, 1e-30, 9e-4, 10_010.0, 1e30)
    ),
    *(  # a file's fps: 0 is the router's default, past the same bounds refused
        (
            grpc_part(video=router_service_pb2.VideoInput(file=b"not read", fps=fps)),
            "messages[0].content[0].video.fps",
        )
        for fps in (-1.0, 1e-40, 1e30)
    ),
    # An empty file reads as none: it was blamed on `frames`, which the caller never set.
    (grpc_part(video=router_service_pb2.VideoInput(file=b"")), "messages[0].content[0].video"),
]


async def refused_naming(stub: Any, request: Any, field: str) -> str:
    """Send `request`; assert it is refused INVALID_ARGUMENT naming `field` (`epd-field`),
    and return the details."""
    call = stub.Generate(request, metadata=bearer_metadata(CLIENT_KEY))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
    assert dict(err.value.trailing_metadata() or ())["epd-field"] == field
    return err.value.details() or ""


async def test_grpc_requests_the_wire_carries_but_the_router_refuses(
    small_bodies: Fakes,
) -> None:
    router, prefill, decode = small_bodies
    stub = router.client._router
    for request, field in GRPC_CASES:
        details = await refused_naming(stub, request, field)
        assert details.startswith(f"{field}: ")
    assert prefill.requests == [] and decode.requests == []  # refused before any worker
    # Real text's spaces, joiners and marks pass (a Persian salt with a zero-width
    # non-joiner was refused as "not printable"); so does a tab.
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"
    salt = persian + " \u00a0\u3000\U0001f469\u200d\U0001f4bb\u00ad\u200f\t"
    ok = grpc_request(request_id="r" * 255 + "\u200d", resume_tokens=[5], cache_salt=salt)
    ok.messages[0].content.add(text="hi")
    # At the bounds it is served: the tokens after the resumed one, to the finish.
    chunks = [c async for c in stub.Generate(ok, metadata=bearer_metadata(CLIENT_KEY))]
    assert sum(len(c.token_ids) for c in chunks) > 0 and chunks[-1].finish_reason


async def test_a_long_request_id_is_refused_without_being_logged_whole(
    small_bodies: Fakes, caplog: pytest.LogCaptureFixture
) -> None:
    # Logged whole before it was checked: a 50 MiB id held the router's loop for a second
    # and grew its log by as much (fuzz review, s37).
    request = grpc_request(request_id="x" * 900_000)
    request.messages[0].content.add(text="hi")
    with caplog.at_level(logging.DEBUG):
        await refused_naming(small_bodies[0].client._router, request, "request_id")
    assert caplog.records and max(len(r.getMessage()) for r in caplog.records) < 2000


async def test_an_empty_uuid_means_none(small_bodies: Fakes) -> None:
    """An image's `uuid` of "" is no uuid (as on every wire of the design), at both front
    doors: served, and no worker gets a uuid for it."""
    router, prefill, _ = small_bodies
    request = grpc_part(image=router_service_pb2.ImageInput(data=PNG, uuid=""))
    metadata = bearer_metadata(CLIENT_KEY)
    chunks = [c async for c in router.client._router.Generate(request, metadata=metadata)]
    assert chunks[-1].finish_reason
    url_part = {"type": "image_url", "image_url": {"url": png_url(32, 32)}, "uuid": ""}
    endpoint = f"{url_of(router)}/v1/chat/completions"
    status, _, reply = await asyncio.to_thread(
        call, endpoint, parts(url_part, TEXT_PART), CLIENT_KEY
    )
    assert status == 200, reply
    assert [list(r.multimodal.mm_uuids) for r in prefill.requests] == [[], []]


async def test_stop_strings_and_resume_tokens_are_refused_before_the_media_is_read(
    small_bodies: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # They were checked after every image and frame was decoded and processed (and the
    # processed-media caches filled, for a request then refused).
    router, _, _ = small_bodies
    servicer = router.router.servicer

    def never(*args: object) -> None:
        raise AssertionError("the media was read")

    monkeypatch.setattr(servicer, "_prepare", never)
    stub = router.client._router
    image = grpc_part(image=router_service_pb2.ImageInput(data=PNG))
    bad_stop = router_service_pb2.GenerateRequest()
    bad_stop.CopyFrom(image)
    bad_stop.stop.append("")
    resumed = router_service_pb2.GenerateRequest()
    resumed.CopyFrom(image)
    resumed.sampling.max_tokens = 2
    resumed.resume_tokens.extend([1, 2])
    for request, field in ((bad_stop, "stop"), (resumed, "resume_tokens")):
        await refused_naming(stub, request, field)
    # The client says which field too (it dropped the router's `epd-field`).
    with pytest.raises(GenerateError) as refused:
        await router.client.generate_text(TEXT, SamplingParams(max_tokens=2), stop=[""])
    assert (refused.value.field, refused.value.retry_after_s) == ("stop", None)
