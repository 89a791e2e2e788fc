"""`[router] requests_in_flight_mb`: the bytes of requests the router holds at once, over
gRPC and HTTP together (`router.held`). A request past the bound is refused with a back-off
hint unless no other is held; once the holders are gone it is served."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest
from PIL import Image

from common.sampling import SamplingParams
from common.server.credentials import bearer_metadata
from epd.client import Chunk, Client, GenerateError
from epd.v1 import router_service_pb2
from router.held import HeldBytes
from router.request_bytes import decoded_bytes
from tests.cluster import CLIENT_KEY
from tests.test_bad_input import chat, grpc_request, post_raw
from tests.test_http_api import add_workers, fake_router, url_of
from tests.test_http_connections import metrics_page
from tests.test_router import Cluster as FakeCluster
from tests.test_router import FakeDecode

LARGE = "x" * (600 << 10)  # an HTTP body's padding: two of these pass the 1 MiB bound


def noise_png(side: int = 460) -> bytes:
    """A PNG of random pixels: about 620 KiB, two of which pass the 1 MiB bound."""
    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_request_past_the_bound_is_refused_unless_it_is_alone() -> None:
    held = HeldBytes(100)
    assert held.take(150)  # alone: taken, however large
    assert not held.take(1)
    held.give(150)
    assert held.take(60) and held.take(40) and not held.take(1)
    assert held.take(10, mine=100)  # nobody else holds any: the one holder may grow
    assert HeldBytes(0).take(1 << 40)  # 0: no bound


@pytest.fixture
async def bounded(ckpt: Path) -> AsyncIterator[tuple[FakeCluster, FakeDecode]]:
    """A router holding at most 1 MiB of requests, any tenant all of it."""
    c = await fake_router(ckpt, max_message_mb=1, requests_in_flight_mb=1, tenant_share=1.0)
    _, decode = await add_workers(c)
    yield c, decode
    await c.close()


async def test_grpc_requests_held_at_once_are_bounded_with_the_http_bodies(
    bounded: tuple[FakeCluster, FakeDecode],
) -> None:
    router, decode = bounded
    decode.hang_after_first = True  # a stream holds its request until it is cancelled
    stub = router.client._router
    metadata = bearer_metadata(CLIENT_KEY)
    png = noise_png()
    assert 600 << 10 < len(png) < 1 << 20

    def large_request(name: str) -> router_service_pb2.GenerateRequest:
        request = grpc_request(request_id=name)
        request.messages[0].content.add(image=router_service_pb2.ImageInput(data=png))
        request.messages[0].content.add(text="what is it?")
        return request

    def large(name: str) -> grpc.aio.UnaryStreamCall:
        return stub.Generate(large_request(name), metadata=metadata)

    holder_size = len(large_request("holder").SerializeToString())
    holder = large("holder")
    await holder.read()  # its first chunk: the router holds the request now
    second = large("second")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await second.read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_in_flight_mb" in (err.value.details() or "")
    assert dict(err.value.trailing_metadata() or ())["retry-after-ms"] == "1000"
    # The HTTP API counts against the same bound.
    body = json.dumps(chat(max_tokens=2, user=LARGE)).encode()
    status, reply = await asyncio.to_thread(post_raw, url_of(router), body)
    assert status == 429 and reply["error"]["type"] == "rate_limit_error", reply
    page = await asyncio.to_thread(metrics_page, url_of(router))
    assert "epd:requests_refused_held_total 2.0" in page  # the gRPC call and the HTTP body
    # Each a request that ended refused, though none reached `generate`.
    assert 'epd:requests_finished_total{outcome="refused"} 2.0' in page
    held = router.router.servicer.held.held  # its bytes and its image's codes
    assert held > holder_size and f"epd:requests_held_bytes {float(held)}" in page
    small = grpc_request(request_id="small")
    small.messages[0].content.add(text="hi")
    small_call = stub.Generate(small, metadata=metadata)
    assert (await small_call.read()).token_ids  # small ones still pass
    small_call.cancel()
    holder.cancel()
    for _ in range(100):  # the holder's bytes come back once the router sees it gone
        if router.router.servicer.held.held == 0:
            break
        await asyncio.sleep(0.05)
    third = large("third")
    assert (await third.read()).token_ids
    third.cancel()


async def test_a_client_with_retries_waits_as_the_refusal_says_then_is_served(
    bounded: tuple[FakeCluster, FakeDecode],
) -> None:
    """`Client(max_retries=N)`: a request refused as RESOURCE_EXHAUSTED (`retry-after-ms`,
    here 1 s) is sent again after that wait; without retries it fails at once."""
    router, decode = bounded
    decode.hang_after_first = True
    png = noise_png()
    parts = [{"type": "image", "image": png}, {"type": "text", "text": "what is it?"}]
    chat_of = [{"role": "user", "content": parts}]
    sampling = SamplingParams(max_tokens=2)
    # A stream that holds its request until it is closed (the fake decode hangs after its
    # first chunk, so the answer must be longer than that).
    holder = cast(
        AsyncGenerator[Chunk, None],
        router.client.generate(chat_of, SamplingParams(max_tokens=16), request_id="holder"),
    )
    await anext(holder)  # the router holds its request now
    address = router.router.address
    async with Client(address, api_key=CLIENT_KEY) as plain:
        with pytest.raises(GenerateError) as err:
            await plain.generate_text(chat_of, sampling, timeout_s=30)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    async with Client(address, api_key=CLIENT_KEY, max_retries=3) as patient:
        started = asyncio.get_running_loop().time()
        waiting = asyncio.ensure_future(patient.generate_text(chat_of, sampling, timeout_s=30))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # refused, waiting out the second it was told
        await holder.aclose()  # the holder goes: its bytes come back
        assert (await waiting).token_ids
        assert 1 <= patient.busy_retries <= 3
        assert asyncio.get_running_loop().time() - started >= 1.0
    with pytest.raises(ValueError, match="max_retries"):
        Client(address, api_key=CLIENT_KEY, max_retries=-1)


@pytest.fixture
async def one_read(ckpt: Path) -> AsyncIterator[FakeCluster]:
    """A router reading one request at a time (bound / max_message_mb = 1), each within a
    second of its read beginning (`request_timeout_s`)."""
    c = await fake_router(ckpt, max_message_mb=1, requests_in_flight_mb=1, request_timeout_s=1.0)
    await add_workers(c)
    yield c
    await c.close()


def raw_generate(c: FakeCluster) -> grpc.aio.StreamStreamMultiCallable:
    """Generate as the router serves it (request-streaming), to send no request on."""
    return c.client._channels[0].stream_stream(
        "/epd.v1.RouterService/Generate",
        request_serializer=router_service_pb2.GenerateRequest.SerializeToString,
        response_deserializer=router_service_pb2.GenerateResponse.FromString,
    )


async def nothing_sent() -> AsyncIterator[router_service_pb2.GenerateRequest]:
    """A request stream that never sends one (nor ends)."""
    await asyncio.Event().wait()
    yield router_service_pb2.GenerateRequest()  # pragma: no cover


async def test_a_sender_that_stalls_gives_its_read_back(one_read: FakeCluster) -> None:
    """A caller that opens Generate and sends nothing holds the one read until the
    request's time is up (DEADLINE_EXCEEDED); a request behind it waits, then is served,
    and one more behind that is refused at once. One that half-closes without a request is
    INVALID_ARGUMENT."""
    metadata = bearer_metadata(CLIENT_KEY)
    raw = raw_generate(one_read)
    stalled = raw(nothing_sent(), metadata=metadata)
    await asyncio.sleep(0.2)  # its handler holds the read now
    request = grpc_request(request_id="behind")
    request.messages[0].content.add(text="hi")
    behind = asyncio.ensure_future(
        one_read.client._router.Generate(request, metadata=metadata).read()
    )
    await asyncio.sleep(0.3)
    assert not behind.done()  # waits for the read
    # One call may wait (bound / 4 MiB window, at least one): the next is refused at once.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await one_read.client._router.Generate(request, metadata=metadata).read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting to be read" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stalled.read()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not arrive" in (err.value.details() or "")
    assert (await asyncio.wait_for(behind, 10)).token_ids
    empty = raw(iter(()), metadata=metadata)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await empty.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_bytes_that_are_no_request_are_invalid_and_give_the_read_back(
    one_read: FakeCluster,
) -> None:
    metadata = bearer_metadata(CLIENT_KEY)
    corrupt = one_read.client._channels[0].unary_stream(
        "/epd.v1.RouterService/Generate",
        request_serializer=bytes,
        response_deserializer=router_service_pb2.GenerateResponse.FromString,
    )
    for data in (b"\xff\xff\xff", b"\x0a\x05abc"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await corrupt(data, metadata=metadata).read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "not a GenerateRequest" in (err.value.details() or "")
    request = grpc_request(request_id="after")
    request.messages[0].content.add(text="hi")
    assert (await one_read.client._router.Generate(request, metadata=metadata).read()).token_ids


def solid_frames(first: int, n: int = 32, side: int = 256) -> list[bytes]:
    """`n` one-colour PNG frames: about 24 KB sent, 98 KB of patch codes once processed."""
    frames = []
    for k in range(first, first + n):
        buffer = io.BytesIO()
        Image.fromarray(np.full((side, side, 3), k, np.uint8)).save(buffer, format="PNG")
        frames.append(buffer.getvalue())
    return frames


async def test_media_count_against_the_bound_before_they_are_decoded(
    bounded: tuple[FakeCluster, FakeDecode],
) -> None:
    """A request's media are held beside its bytes (what they decode to, from their
    headers, then their patch codes): a compressed image or video is many times larger
    once read, so counting the wire alone would let small requests hold far more than the
    bound."""
    router, decode = bounded
    decode.hang_after_first = True
    held = router.router.servicer.held

    def video_chat(first: int) -> router_service_pb2.GenerateRequest:
        request = grpc_request(request_id=f"video{first}")
        video = router_service_pb2.VideoInput(fps=2.0)
        video.frames.extend(solid_frames(first))
        request.messages[0].content.add(video=video)
        request.messages[0].content.add(text="what happens?")
        return request

    # One video request's bytes and codes fit, two do not; the second's read does.
    held.limit = 150_000 + decoded_bytes(video_chat(64))
    first = video_chat(0)
    assert first.ByteSize() < 40_000
    stub, metadata = router.client._router, bearer_metadata(CLIENT_KEY)
    holder = stub.Generate(first, metadata=metadata)
    await holder.read()
    assert held.held > 3 * first.ByteSize()  # its codes are held, not only its bytes
    second = stub.Generate(video_chat(64), metadata=metadata)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await second.read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "media" in (err.value.details() or "")
    assert dict(err.value.trailing_metadata() or ())["retry-after-ms"] == "1000"
    # Over HTTP the same: an image of a few KB whose codes do not fit is a 429.
    picture = solid_frames(200, n=1, side=1024)[0]
    url = {"url": "data:image/png;base64," + base64.b64encode(picture).decode()}
    body = json.dumps(
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": url}]}])
    ).encode()
    assert len(body) < 10_000
    status, reply = await asyncio.to_thread(post_raw, url_of(router), body)
    assert status == 429 and "media" in reply["error"]["message"], reply
    holder.cancel()
    for _ in range(100):
        if held.held == 0:
            break
        await asyncio.sleep(0.05)
    assert held.held == 0  # everything given back


def test_a_request_of_many_empty_messages_counts_what_it_holds_decoded() -> None:
    # 2 bytes a message on the wire, ~45 decoded: counted at the wire size alone, 1 GiB of
    # `requests_in_flight_mb` held ~22 GiB of them.
    from epd.v1 import router_service_pb2
    from router.request_bytes import ELEMENT_BYTES, decode_request

    request = router_service_pb2.GenerateRequest()
    for _ in range(10_000):
        request.messages.add()
    data = request.SerializeToString()
    sized = decode_request(data, 32768)
    assert len(data) == 20_000 and sized.size == len(data) + 10_000 * ELEMENT_BYTES


def test_video_frames_and_token_lists_count_what_they_hold_decoded() -> None:
    # Empty frames are 2 bytes on the wire and small token ids 1 byte: counted at the wire
    # size alone, a request held 8-14x its count (3.6 GiB from one 256 MiB message).
    from router.request_bytes import ELEMENT_BYTES, INT_BYTES, decode_request

    request = router_service_pb2.GenerateRequest()
    video = request.messages.add().content.add().video
    video.frames.extend([b""] * 5_000)
    request.resume_tokens.extend([1] * 3_000)
    request.sampling.stop_token_ids.extend([2] * 1_000)
    data = request.SerializeToString()
    counted = decode_request(data, 32768).size - len(data)
    assert counted == ELEMENT_BYTES * (1 + 1 + 5_000) + INT_BYTES * 4_000


async def test_an_http_body_counts_what_it_holds_parsed(
    bounded: tuple[FakeCluster, FakeDecode],
) -> None:
    # 2,000 one-letter messages: ~60 KiB of JSON, ~1.3 MB parsed. Counted as its JSON, it
    # passed the 1 MiB bound beside a held 620 KiB request.
    router, decode = bounded
    decode.hang_after_first = True
    stub = router.client._router
    request = grpc_request(request_id="holder")
    request.messages[0].content.add(image=router_service_pb2.ImageInput(data=noise_png()))
    holder = stub.Generate(request, metadata=bearer_metadata(CLIENT_KEY))
    await holder.read()  # held now
    body = chat(max_tokens=2)
    body["messages"] = [{"role": "user", "content": "a"}] * 2_000
    raw = json.dumps(body).encode()
    assert len(raw) < 100 << 10
    status, reply = await asyncio.to_thread(post_raw, url_of(router), raw)
    assert status == 429 and reply["error"]["type"] == "rate_limit_error", reply
    holder.cancel()
    for _ in range(100):
        if router.router.servicer.held.held == 0:
            break
        await asyncio.sleep(0.05)
    assert router.router.servicer.held.held == 0  # the refused body's bytes given back too


async def test_a_cancelled_calls_decode_holds_its_read_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The decode ran on a thread beyond the read slots once its call was cancelled, holding
    # its bytes: one client cancelling 107 MiB requests grew a router 230 MB/s (ownfix review).
    import router.held as held_module

    release, decoding = threading.Event(), threading.Event()

    def slow(data: bytes, max_model_len: int, max_text_bytes: int | None) -> Any:
        decoding.set()
        release.wait(10)
        raise held_module.DecodeError("never mind")

    monkeypatch.setattr(held_module, "decode_request", slow)
    held = HeldBytes(1 << 20, 1 << 20)  # one read at a time

    class Context:
        async def read(self) -> bytes:
            return b"\x0a\x01x"

    call = asyncio.ensure_future(held_module.read_request(held, cast(Any, Context()), 5, None, 10))
    assert await asyncio.to_thread(decoding.wait, 5)
    call.cancel()
    await asyncio.sleep(0.1)
    assert held.reads.locked()  # still held: its decode runs
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not held.reads.locked()
