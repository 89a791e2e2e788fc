"""The HTTP API reads a request as JSON and HTTP have it, and refuses what is ambiguous
(a review against OpenAI's API, s29): a key named twice, a header sent twice, a boolean
for a count, a compressed body or a charset `json.loads` cannot read, an OpenAI field that
asks for what is not done. Each was accepted and served as one reading of it.

The body's parsing without a server (`router.http.parse.parse_body`, then the conversion);
the head's checks (`router.http.body`) against a router with no workers, over raw sockets.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from common.errors import FieldError
from router.http.convert import chat_request, completion_request
from router.http.errors import ApiError
from router.http.media import MediaPolicy
from router.http.parse import parse_body
from router.http.schema import ACCEPTED_AND_IGNORED, ChatCompletionRequest, CompletionRequest
from tests.cluster import CLIENT_KEY
from tests.test_http_api import MODEL_ID, fake_router, png_data_url, url_of
from tests.test_router import Cluster as FakeCluster

HI = '[{"role": "user", "content": "hi"}]'

# The async tests share one router (`router`): they run on the module's event loop.
ON_ROUTER = pytest.mark.asyncio(loop_scope="module")


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **extra}


def refused(data: bytes | str, content_type: str | None = "application/json") -> ApiError:
    """What `parse_body` answers a chat body it refuses."""
    raw = data.encode() if isinstance(data, str) else data
    with pytest.raises(ApiError) as err:
        parse_body(raw, content_type, ChatCompletionRequest)
    return err.value


# ------------------------------------------------------------------------- the body's JSON


@pytest.mark.parametrize(
    ("data", "param"),
    [
        (f'{{"model": "nope", "model": "{MODEL_ID}", "messages": {HI}}}', "model"),
        (f'{{"model": "{MODEL_ID}", "messages": {HI}, "messages": {HI}}}', "messages"),
        (f'{{"model": "{MODEL_ID}", "messages": {HI}, "stream": false, "stream": true}}', "stream"),
        (
            f'{{"model": "{MODEL_ID}", "messages": [{{"role": "user", "content": [{{"type": '
            '"image_url", "type": "text", "text": "x"}]}]}',
            "messages[0].content[0].type",
        ),
        (
            f'{{"model": "{MODEL_ID}", "messages": [{HI[1:-1]}, {{"role": "user", "role": '
            '"system", "content": "x"}]}',
            "messages[1].role",
        ),
    ],
)
def test_a_key_named_twice_is_refused_by_its_path(data: str, param: str) -> None:
    # The last one was served: a proxy in front that reads the first checked another
    # model, prompt or stream than the router served.
    error = refused(data)
    assert (error.status, error.param) == (400, param), str(error)
    assert str(error) == f"the body names {param!r} twice"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant: str) -> None:
    # `"fps": NaN` was refused as "less than or equal to 10000".
    error = refused(f'{{"model": "{MODEL_ID}", "messages": {HI}, "temperature": {constant}}}')
    assert (error.status, error.param) == (400, None)
    assert str(error) == f"the body is not valid JSON: {constant} is not a JSON value"


def test_a_charset_json_cannot_read_is_refused_saying_send_utf8() -> None:
    body = json.dumps(chat(messages=[{"role": "user", "content": "café"}]), ensure_ascii=False)
    latin = body.encode("latin-1")
    error = refused(latin, "application/json; charset=iso-8859-1")
    assert error.status == 415 and str(error) == (
        "charset iso-8859-1 is not supported: send the body as UTF-8"
    )
    assert refused(body.encode(), "application/json; charset=no-such-charset").status == 415
    # Undeclared, it was refused naming the 'utf-8' codec only.
    error = refused(latin, "application/json")
    assert error.status == 400 and str(error).endswith("send it as UTF-8"), str(error)
    for charset in ("utf-8", "UTF8", "us-ascii", "utf-16"):
        data = body.encode("utf-16" if charset == "utf-16" else "utf-8")
        parsed = parse_body(data, f"application/json; charset={charset}", ChatCompletionRequest)
        assert parsed.messages[0].content == "café"


# -------------------------------------------------------------------------- strict types


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": True}, "max_tokens"),  # was 1 token, finish_reason length
        ({"max_tokens": "3"}, "max_tokens"),
        ({"max_tokens": 3.5}, "max_tokens"),
        ({"max_completion_tokens": False}, "max_completion_tokens"),
        ({"seed": "5"}, "seed"),
        ({"top_k": "3"}, "top_k"),
        ({"n": True}, "n"),
        ({"stream": "yes"}, "stream"),  # was a stream
        ({"stream": 1}, "stream"),
        ({"ignore_eos": "on"}, "ignore_eos"),
        ({"temperature": True}, "temperature"),  # was 1.0
        ({"temperature": "0"}, "temperature"),
        ({"logprobs": "1"}, "logprobs"),  # a union's labels are not in the param
        ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
        ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options"),
    ],
)
def test_booleans_and_integers_are_not_read_from_strings_or_each_other(
    extra: dict[str, Any], param: str
) -> None:
    error = refused(json.dumps(chat(**extra)))
    assert error.status == 400 and error.param is not None, str(error)
    assert error.param.startswith(param) and str(error).startswith(f"{error.param}: "), str(error)


def test_json_numbers_still_fit_number_fields() -> None:
    # A float field takes a JSON integer; an integer field a whole number written as a
    # float (Python clients send a computed count as 3.0), as pydantic's lax mode did.
    extra = {"temperature": 1, "top_p": 1, "max_tokens": 3.0, "seed": 7.0, "logprobs": False}
    body = parse_body(json.dumps(chat(**extra)).encode(), None, ChatCompletionRequest)
    assert (body.temperature, body.top_p, body.max_tokens, body.seed) == (1.0, 1.0, 3, 7)
    assert type(body.max_tokens) is int and type(body.seed) is int
    assert chat_request(body, "r", MediaPolicy()).sampling.max_tokens == 3


# --------------------------------------------------------------- fields asked for, not done


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"web_search_options": {}}, "web_search_options"),  # `{}` asks for a search
        ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
        ({"moderation": {"input": {"policy": "default"}}}, "moderation"),
        ({"store": True}, "store"),
        ({"response_format": {}}, "response_format"),  # was read as text
        ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format"),
        ({"max_tokens": 3, "max_completion_tokens": 5}, "max_completion_tokens"),
    ],
)
def test_what_is_asked_for_and_not_done_is_refused(extra: dict[str, Any], param: str) -> None:
    body = parse_body(json.dumps(chat(**extra)).encode(), None, ChatCompletionRequest)
    with pytest.raises(FieldError) as err:
        chat_request(body, "r", MediaPolicy())
    assert err.value.field == param
    if "max_tokens" in extra:  # both named
        assert "max_tokens is 3" in str(err.value) and "is 5" in str(err.value)


def test_neutral_values_and_the_ignored_fields_are_accepted() -> None:
    ignored = {k: "x" for k in ACCEPTED_AND_IGNORED if k.isidentifier()}
    assert {"metadata", "service_tier", "reasoning_effort", "parallel_tool_calls"} <= set(ignored)
    image = {"type": "image_url", "image_url": {"url": png_data_url(1), "detail": "low"}}
    messages = [{"role": "user", "content": [image], "name": "ann"}]
    extra: dict[str, Any] = {"store": False, "web_search_options": None, "moderation": None}
    extra |= ignored
    extra |= {"response_format": {"type": "text"}, "max_tokens": 4, "max_completion_tokens": 4}
    body = parse_body(
        json.dumps(chat(messages=messages, **extra)).encode(), None, ChatCompletionRequest
    )
    assert chat_request(body, "r", MediaPolicy()).sampling.max_tokens == 4
    prompt = CompletionRequest.model_validate({"model": MODEL_ID, "prompt": "x", "store": True})
    assert completion_request(prompt, "r").prompt == "x"  # a chat's field only


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([], "messages[0].content"),  # OpenAI refuses an empty array; it was an empty turn
        (
            [{"type": "image_url", "image_url": {"url": "data:,", "detail": "bogus"}}],
            "messages[0].content[0].image_url.detail",
        ),
    ],
)
def test_an_empty_content_or_an_unknown_detail_is_refused(content: Any, param: str) -> None:
    error = refused(json.dumps(chat(messages=[{"role": "user", "content": content}])))
    assert (error.status, error.param) == (400, param), str(error)


def test_an_internal_error_is_openais_server_error() -> None:
    error = ApiError(grpc.StatusCode.INTERNAL, "internal error")
    assert (error.status, error.body()["error"]["type"]) == (500, "server_error")


# ------------------------------------------------------------------------- the request head


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(ckpt: Path) -> AsyncIterator[FakeCluster]:
    """One router for the module's tests of the request head (on the module's loop)."""
    c = await fake_router(ckpt, max_message_mb=1)  # no workers: refusals come first
    yield c
    await c.close()


async def exchange(c: FakeCluster, head: str, body: bytes = b"") -> tuple[int, dict[str, str], Any]:
    """Send a request head (its lines, without the blank line) and `body` on a new
    connection: the answer's status, headers (lower-case names) and JSON body (None: none).
    A `connection` header of "close" is checked: the router closes the connection."""
    host, port = url_of(c).removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{head}\r\nHost: x\r\n\r\n".encode() + body)
        lines = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if x)}
        length = int(headers.get("content-length", "0"))
        data = await asyncio.wait_for(reader.readexactly(length), 10)
        if headers.get("connection") == "close":
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
        return status, headers, json.loads(data) if data else None
    finally:
        writer.close()


POST = "POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json"
KEY = f"Authorization: Bearer {CLIENT_KEY}"
BODY = json.dumps(chat(max_tokens=2)).encode()


@pytest.mark.parametrize(
    "head",
    [
        f"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer bad\r\n{KEY}",
        f"GET /v1/models HTTP/1.1\r\n{KEY}\r\nAuthorization: Bearer bad",
        f"{POST}\r\nAuthorization: Bearer bad\r\n{KEY}\r\nContent-Length: {len(BODY)}",
        f"{POST}\r\n{KEY}\r\n{KEY}\r\nContent-Length: {len(BODY)}",
        f"{POST}\r\n{KEY}\r\nContent-Type: text/plain\r\nContent-Length: {len(BODY)}",
    ],
)
@ON_ROUTER
async def test_a_header_sent_twice_is_refused_on_every_method(
    router: FakeCluster, head: str
) -> None:
    # GET read the first Authorization, POST the last: a proxy that adds its own key was
    # honoured on one and not the other.
    status, headers, reply = await exchange(router, head, b"" if "GET" in head else BODY)
    assert status == 400, reply
    assert "more than one" in reply["error"]["message"], reply
    assert "connection" not in headers  # a POST's body, sent whole, was read and dropped


@ON_ROUTER
async def test_a_compressed_body_is_415_before_it_is_read(router: FakeCluster) -> None:
    head = f"{POST}\r\n{KEY}\r\nContent-Encoding: gzip\r\nContent-Length: {len(BODY)}"
    status, headers, reply = await exchange(router, head, BODY)
    assert status == 415, reply
    assert reply["error"]["message"] == (
        "Content-Encoding gzip is not supported: send the body uncompressed"
    )
    assert "connection" not in headers  # its body, sent whole, was read and dropped
    # identity is no coding; without workers the (parsed) request gets 503.
    head = f"{POST}\r\n{KEY}\r\nContent-Encoding: identity\r\nContent-Length: {len(BODY)}"
    assert (await exchange(router, head, BODY))[0] == 503


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (f"{POST}\r\n{KEY}\r\nContent-Length: {1 << 40}", 413),
        (f"{POST}\r\nAuthorization: Bearer bad\r\nContent-Length: {1 << 20}", 401),
        (f"{POST}\r\nContent-Length: {1 << 20}", 401),
        (f"{POST}\r\nAuthorization: Bearer bad\r\nTransfer-Encoding: chunked", 401),
    ],
)
@ON_ROUTER
async def test_a_refusal_before_a_body_that_does_not_come_closes_the_connection(
    router: FakeCluster, head: str, status: int
) -> None:
    # The connection was kept and the body drained, up to the Content-Length announced:
    # one past `DRAIN_BYTES` is not waited for, one not sent for `DRAIN_IDLE_S` no longer.
    got, headers, reply = await exchange(router, head)
    assert got == status, reply
    assert headers.get("connection") == "close", headers


@pytest.mark.parametrize(
    ("key", "size", "status"),
    [
        (f"Bearer {CLIENT_KEY}", 3 << 20, 413),  # past max_message_mb, within DRAIN_BYTES
        ("Bearer bad", 200 << 10, 401),  # within DRAIN_ANONYMOUS_BYTES
    ],
)
@ON_ROUTER
async def test_a_refused_body_sent_whole_is_read_before_the_answer(
    router: FakeCluster, key: str, size: int, status: int
) -> None:
    # Closed at once, a client that sends its whole body before it reads (http.client,
    # httpx) got BrokenPipeError instead of its 401 or 413.
    body = b" " * size
    head = f"{POST}\r\nAuthorization: {key}\r\nContent-Length: {len(body)}"
    got, headers, reply = await exchange(router, head, body)
    assert got == status, reply
    assert "connection" not in headers  # it may serve the next request


@ON_ROUTER
async def test_a_caller_without_credentials_gets_no_large_body_read(router: FakeCluster) -> None:
    # Every refused body was read up to 16 MiB: twenty keyless 16 MiB posts cost the router
    # 28 ms of CPU each. gRPC reads nothing of such a caller's request.
    head = f"{POST}\r\nAuthorization: Bearer bad\r\nContent-Length: {1 << 20}"
    got, headers, reply = await exchange(router, head)
    assert got == 401, reply
    assert headers.get("connection") == "close"


@ON_ROUTER
async def test_a_body_refused_before_it_runs_is_counted_as_a_request(router: FakeCluster) -> None:
    # Counting lived in `generate` alone: a body the API refused moved no metric.
    finished = router.router.servicer.orchestrator.metrics.finished.labels("invalid")
    before = finished._value.get()
    body = json.dumps(chat(max_tokens=True)).encode()
    head = f"{POST}\r\n{KEY}\r\nContent-Length: {len(body)}"
    got, _, reply = await exchange(router, head, body)
    assert got == 400 and reply["error"]["param"] == "max_tokens", reply
    assert finished._value.get() == before + 1


@ON_ROUTER
async def test_a_key_named_twice_is_shown_escaped_and_cut(router: FakeCluster) -> None:
    # A lone surrogate in it could not be encoded in the answer: a 500 and a traceback.
    for key, shown in (("\\ud800", "\\ud800"), ("k" * 100_000, "k" * 200)):
        body = f'{{"model": "tiny", "{key}": 1, "{key}": 2}}'.encode()
        head = f"{POST}\r\n{KEY}\r\nContent-Length: {len(body)}"
        got, _, reply = await exchange(router, head, body)
        assert got == 400, reply
        assert reply["error"]["param"] == shown and len(reply["error"]["message"]) < 300


@ON_ROUTER
async def test_a_refusal_of_a_request_without_a_body_keeps_the_connection(
    router: FakeCluster,
) -> None:
    status, headers, _ = await exchange(router, "GET /v1/models HTTP/1.1")
    assert status == 401 and "connection" not in headers


@pytest.mark.parametrize(
    ("head", "body"),
    [
        (f"{POST.replace('completions', 'completions/')}\r\n{KEY}", BODY),
        (f"GET /health/ HTTP/1.1\r\n{KEY}", b""),
    ],
)
@ON_ROUTER
async def test_a_trailing_slash_is_an_openai_404_not_a_redirect(
    router: FakeCluster, head: str, body: bytes
) -> None:
    # A bare 307 to a Location built from the Host header, which clients follow.
    head += f"\r\nContent-Length: {len(body)}" if body else ""
    status, headers, reply = await exchange(router, head, body)
    assert status == 404 and "location" not in headers, headers
    assert reply["error"]["type"] == "not_found_error", reply


@ON_ROUTER
async def test_head_health_is_answered_as_get(router: FakeCluster) -> None:
    host, port = url_of(router).removeprefix("http://").rsplit(":", 1)

    def ask(method: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request(method, "/health")
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    got, body = await asyncio.to_thread(ask, "GET")
    assert got == 503 and body  # no workers
    assert await asyncio.to_thread(ask, "HEAD") == (got, b"")


@ON_ROUTER
async def test_a_key_named_twice_is_refused_over_http(router: FakeCluster) -> None:
    data = f'{{"model": "nope", "model": "{MODEL_ID}", "messages": {HI}}}'.encode()
    status, _, reply = await exchange(
        router, f"{POST}\r\n{KEY}\r\nContent-Length: {len(data)}", data
    )
    assert (status, reply["error"]["param"]) == (400, "model"), reply
    assert reply["error"]["message"] == "the body names 'model' twice"


@ON_ROUTER
async def test_a_client_gone_while_sending_its_body_is_counted_not_a_traceback(
    router: FakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # A keyed client hanging up mid-body raised ClientDisconnect into uvicorn: an ERROR
    # "Exception in ASGI application" with a traceback, and no count.
    caplog.set_level(logging.INFO)
    metrics = router.router.servicer.orchestrator.metrics.finished
    cancelled, invalid = metrics.labels("cancelled"), metrics.labels("invalid")
    before = cancelled._value.get(), invalid._value.get()
    host, port = url_of(router).removeprefix("http://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"{POST}\r\n{KEY}\r\nContent-Length: 1000\r\nHost: x\r\n\r\n".encode() + b"{")
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    for _ in range(50):
        if cancelled._value.get() > before[0]:
            break
        await asyncio.sleep(0.05)
    assert cancelled._value.get() == before[0] + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # A body refused on a path that runs no request is not a request (it was "invalid").
    body = b" " * (2 << 20)
    head = f"POST /health HTTP/1.1\r\n{KEY}\r\nContent-Length: {len(body)}"
    assert (await exchange(router, head, body))[0] == 413
    assert invalid._value.get() == before[1]


def test_chunks_carry_the_null_fields_openai_documents() -> None:
    # With include_usage every chunk before the usage one says "usage": null, and every
    # choice "logprobs": null (completions' had no such key, streamed chats' neither).
    from router.http.stream import Answer

    for chat_api in (True, False):
        answer = Answer("id-1", "tiny", chat_api)
        with_usage = answer.delta("hi", None, True, usage=True)
        assert with_usage["usage"] is None and with_usage["choices"][0]["logprobs"] is None
        assert "usage" not in answer.delta("hi", None, False)
        assert answer.final()["choices"][0]["logprobs"] is None
