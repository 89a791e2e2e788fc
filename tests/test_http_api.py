"""The router's OpenAI-compatible HTTP API (`router.http`), driven with the `openai` client.

A router in this event loop with fake workers (errors, health, stop strings: fast and
exact; admission's 429 and 400 in `tests.test_http_admission`), and the request conversion
and stop-string cutting without a server. The
helpers here (`fake_router`, `add_workers`, `call`, ...) serve other HTTP tests;
`tests.test_http_deployment` holds the tests against a real deployment.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from common.models.tiny import make_tiny_checkpoint
from common.roles import Role
from common.server.lifecycle import LifecycleState
from common.server.rpc import LIVENESS_SERVICE, channel
from router.http.convert import chat_request
from router.http.media import MediaPolicy
from router.http.schema import ChatCompletionRequest
from router.server import serve
from router.settings import RouterSettings
from tests.cluster import CLIENT_KEY, cluster_security
from tests.model_fixtures import user
from tests.test_router import Cluster as FakeCluster
from tests.test_router import FakeDecode, FakeEncoder, FakePrefill

MODEL_ID = "tiny"  # the served model name both set-ups use


def png_data_url(seed: int, w: int = 64, h: int = 48) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


WEATHER = user({"type": "text", "text": "Describe the weather."})


def call(url: str, body: Any = None, key: str | None = None) -> tuple[int, dict[str, str], Any]:
    """One plain HTTP request (blocking): status, headers, JSON body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return (
                reply.status,
                {k.lower(): v for k, v in reply.headers.items()},
                json.loads(reply.read()),
            )
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def raw_post(url: str, data: bytes) -> tuple[int, dict[str, str], Any]:
    """POST `data` as it is (a client's key): status, headers, JSON body."""
    request = urllib.request.Request(url, data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {CLIENT_KEY}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers.items()), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), json.loads(exc.read())


def api(url: str, key: str = CLIENT_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


# ----------------------------------------------------------- request conversion (no server)


def test_parts_become_the_grpc_request() -> None:
    mp4 = b"\x00\x00\x00\x18ftypmp42 not really a video"
    body = ChatCompletionRequest.model_validate(
        {
            "model": MODEL_ID,
            "messages": [
                {"role": "system", "content": "Be brief."},
                user(
                    {"type": "image_url", "image_url": {"url": png_data_url(1)}, "uuid": "cat"},
                    {
                        "type": "video_url",
                        "video_url": {
                            "url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()
                        },
                        "fps": 2,
                    },
                    {"type": "text", "text": "What changes?"},
                )[0],
            ],
            "temperature": 0,
            "top_k": -1,
            "seed": 7,
            "max_completion_tokens": 5,
            "stop": "\n",
            "cache_salt": "end-user-7",
        }
    )
    request = chat_request(body, "r1", MediaPolicy())
    assert request.cache_salt == "end-user-7"
    system, question = request.messages
    assert (system.role, system.content[0].text) == ("system", "Be brief.")
    image, video, text = question.content
    assert image.image.uuid == "cat" and image.image.data.startswith(b"\x89PNG")
    assert (video.video.file, video.video.fps, list(video.video.frames)) == (mp4, 2.0, [])
    assert text.text == "What changes?"
    s = request.sampling
    # top_k -1 (vLLM's "off") is sent as off (0), not left unset for the checkpoint's
    assert (s.temperature, s.HasField("top_k"), s.top_k, s.seed, s.max_tokens) == (
        0.0,
        True,
        0,
        7,
        5,
    )
    assert not s.HasField("top_p")  # unset: the checkpoint's
    assert list(request.stop) == ["\n"]


# ------------------------------------------------------------- a router with fake workers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


async def fake_router(ckpt: Path, **settings: Any) -> FakeCluster:
    """A router on free ports (HTTP API too) for fake workers; `settings` override these."""
    base: dict[str, Any] = {
        "model": str(ckpt),
        "port": 0,
        "http_port": 0,
        "served_model_name": MODEL_ID,
        "expected_model": "fake-model",
        "worker_timeout_s": 60.0,
        "security": cluster_security(),
    }
    return FakeCluster(await serve(RouterSettings(**(base | settings))))


@pytest.fixture
async def fake(ckpt: Path) -> AsyncIterator[FakeCluster]:
    c = await fake_router(ckpt, max_queued_requests=0)
    yield c
    await c.close()


def url_of(c: FakeCluster) -> str:
    return f"http://{c.router.http_address}"


async def add_workers(c: FakeCluster) -> tuple[FakePrefill, FakeDecode]:
    pre, dec = FakePrefill(), FakeDecode()
    await c.add(Role.ENCODER, FakeEncoder())
    await c.add(Role.PREFILL, pre)
    await c.add(Role.DECODE, dec)
    return pre, dec


async def wait_health(url: str, status: int) -> None:
    for _ in range(100):
        if (await asyncio.to_thread(call, f"{url}/health"))[0] == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"/health never answered {status}")


async def grpc_health(c: FakeCluster, want: int) -> int:
    """The router's gRPC health once it is `want` (it follows the registry within 0.1 s)."""
    async with channel(c.router.address) as ch:
        for _ in range(40):
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            if reply.status == want:
                break
            await asyncio.sleep(0.05)
    return int(reply.status)


async def test_health_needs_every_role(fake: FakeCluster) -> None:
    await wait_health(url_of(fake), 503)
    # It says which roles lack a serving worker (it said only "unavailable").
    _, _, why = await asyncio.to_thread(call, f"{url_of(fake)}/health")
    missing = ["encoder", "prefill", "decode"]
    assert why == {"status": "unavailable", "draining": False, "missing": missing}
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert await grpc_health(fake, not_serving) == not_serving
    # Alive all the same: a liveness probe must not restart a router waiting for workers.
    async with channel(fake.router.address) as ch:
        alive = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE)
        )
    assert alive.status == health_pb2.HealthCheckResponse.SERVING
    # A request meanwhile is a 503 that says when to look again.
    status, headers, reply = await asyncio.to_thread(
        call,
        f"{url_of(fake)}/v1/chat/completions",
        {"model": MODEL_ID, "messages": WEATHER, "max_tokens": 2},
        CLIENT_KEY,
    )
    assert status == 503 and reply["error"]["type"] == "service_unavailable", reply
    assert headers["retry-after"] == "1"
    await add_workers(fake)
    await wait_health(url_of(fake), 200)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert await grpc_health(fake, serving) == serving


async def test_a_draining_router_asks_each_client_to_close_its_connection(
    fake: FakeCluster,
) -> None:
    # A kept-alive connection came back to a draining router with each request, each one
    # answered 503, as long as its longest running answer lasted (up to drain_timeout_s),
    # while a load balancer had other routers ready for a new connection (deploy review).
    host, port = url_of(fake).removeprefix("http://").rsplit(":", 1)

    def twice() -> list[tuple[int, str | None]]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            answers = []
            for _ in range(2):
                conn.request("GET", "/health")
                reply = conn.getresponse()
                reply.read()
                answers.append((reply.status, reply.getheader("connection")))
                fake.router.servicer.lifecycle.state = LifecycleState.DRAINING
            conn.close()  # a refusal before the body is read too (s34diff review: a 401)
            conn.request("POST", "/v1/completions", b"{}", {"Authorization": "Bearer nope"})
            reply = conn.getresponse()
            return [*answers, (reply.status, reply.getheader("connection"))]
        finally:
            conn.close()

    await add_workers(fake)
    await wait_health(url_of(fake), 200)
    assert await asyncio.to_thread(twice) == [(200, None), (503, "close"), (401, "close")]


async def test_errors_come_in_openai_shape(fake: FakeCluster) -> None:
    await add_workers(fake)
    url = url_of(fake)
    with pytest.raises(openai.AuthenticationError) as unauth:
        await api(url, "not-a-key").chat.completions.create(model=MODEL_ID, messages=WEATHER)
    assert unauth.value.status_code == 401
    with pytest.raises(openai.PermissionDeniedError):  # a service's bearer names no tenant
        await api(url, cluster_security().cluster_bearer() or "").models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        await api(url).chat.completions.create(model="gpt-4o", messages=WEATHER)
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 1 << 20}, "max_tokens"),  # over the context
        ({"stop": [""]}, "stop"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            await api(url).chat.completions.create(model=MODEL_ID, messages=WEATHER, **extra)
        assert err.value.body["param"] == param, err.value.body  # type: ignore[index]
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError) as fetch:
        await api(url).chat.completions.create(model=MODEL_ID, messages=user(image))
    assert fetch.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]
    status, _, reply = await asyncio.to_thread(
        call, f"{url}/v1/chat/completions", {"model": MODEL_ID}
    )
    assert status == 401  # no key: refused before the body is looked at
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"  # OpenAI's code (it was "unauthenticated")
    # Bodies FastAPI cannot parse at all (not UTF-8; nested past the JSON parser's depth)
    # and bodies that are not JSON: refused alike, in OpenAI's shape (no field to name).
    for raw in (b'{"model": "\xff"}', b"[" * 100_000 + b"]" * 100_000, b'{"model": '):
        status, _, reply = await asyncio.to_thread(raw_post, f"{url}/v1/chat/completions", raw)
        assert status == 400 and set(reply["error"]) == {"message", "type", "param", "code"}
        assert reply["error"]["message"].startswith("the body is not valid JSON"), reply


async def test_a_body_of_too_many_objects_is_refused_while_it_is_parsed(fake: FakeCluster) -> None:
    # Validated on the event loop, two million one-letter messages (65 MB) held it for 8 s:
    # every worker was dropped for missed heartbeats and other tenants' streams broke.
    from router.http.parse import MAX_BODY_OBJECTS

    url = url_of(fake)
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "a"}] * MAX_BODY_OBJECTS}
    status, _, reply = await asyncio.to_thread(
        raw_post, f"{url}/v1/chat/completions", json.dumps(body).encode()
    )
    assert status == 400 and "JSON objects" in reply["error"]["message"], reply
    for empty in (b"", b"[]", b'"text"'):
        status, _, reply = await asyncio.to_thread(raw_post, f"{url}/v1/chat/completions", empty)
        assert status == 400 and "must be a JSON object" in reply["error"]["message"], reply


def slow_post(url: str, body: bytes, pause_s: float) -> bytes:
    """POST `body` to the chat endpoint `pause_s` after its head; the raw answer."""
    where = urllib.parse.urlparse(url)
    assert where.hostname is not None and where.port is not None
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {CLIENT_KEY}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(head.encode())
        time.sleep(pause_s)
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


async def test_ttft_counts_an_http_bodys_upload_and_media_from_its_head(
    fake: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The clock started after the body was read, parsed and its media loaded: a 5.8 MB image
    # request waited 0.108 s and counted 0.047 s (metrics review, s33); then after the body's
    # upload (own-fix review).
    import router.http.app

    def slow(*args: Any) -> Any:
        time.sleep(0.3)  # in the prepare threads, as a large image's decode is
        return chat_request(*args)

    monkeypatch.setattr(router.http.app, "chat_request", slow)
    await add_workers(fake)
    body = json.dumps({"model": MODEL_ID, "messages": WEATHER, "max_tokens": 2}).encode()
    answer = await asyncio.to_thread(slow_post, url_of(fake), body, 0.3)
    assert b" 200 " in answer.split(b"\r\n")[0], answer[:300]
    registry = fake.router.orchestrator.metrics.registry
    ttft = registry.get_sample_value("vllm:time_to_first_token_seconds_sum")
    assert ttft is not None and ttft >= 0.6
