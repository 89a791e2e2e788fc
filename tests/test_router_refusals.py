"""Requests the router refuses, against the fake workers of `tests.test_router`.

Pins: malformed media or sampling and messages the processor refuses are INVALID_ARGUMENT
naming the field (the router still serves after), limits refuse before any worker is called,
and a router without workers answers UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.sampling import SamplingParams
from common.server.rpc import MAX_DETAILS, clipped
from epd.client import GenerateError, build_request
from router.stop import TOO_MANY_STOPS
from tests.loop_gaps import loop_gaps
from tests.test_router import FIRST, IMAGE, TEXT, chat, png
from tests.test_router import ckpt as ckpt  # fixture
from tests.test_router import cluster as cluster  # fixture
from tests.test_router import workers as workers  # fixture


@pytest.mark.parametrize(
    ("messages", "sampling", "field"),
    [
        (chat({"type": "image", "image": b"not an image"}), None, "messages[0].content[0].image"),
        (
            chat({"type": "video", "video": [png(1), png(2, 32, 32)], "fps": 2.0}),
            None,
            "messages[0].content[0].video.frames",
        ),
        (TEXT, SamplingParams(max_tokens=2, top_k=0), None),
    ],
)
async def test_malformed_input_is_invalid_argument(cluster, workers, messages, sampling, field):
    enc, pre, _ = workers
    if field is None:  # a sampling error: build a bad request by hand
        request = build_request(messages, sampling)
        request.sampling.temperature = -1.0
        stub_call = cluster.client._router.Generate(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub_call:
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("sampling.temperature: temperature must")
    else:
        with pytest.raises(GenerateError) as err:
            await cluster.client.generate_text(messages)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details
    assert enc.requests == [] and pre.requests == []
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]  # still serving


@pytest.mark.parametrize("stop", [[5] * 20_000, [5] * 3000 + [-1]])
async def test_a_long_stop_token_list_is_invalid_argument_naming_sampling(cluster, workers, stop):
    # 20,000 ids once came back as RESOURCE_EXHAUSTED without a field: the details echoed
    # the whole list and overflowed gRPC's trailers. The count is bounded, details clipped.
    request = build_request(TEXT, SamplingParams(max_tokens=2))
    request.sampling.stop_token_ids[:] = stop
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in cluster.client._router.Generate(request):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.stop_token_ids: ")  # counted from bytes
    assert "1024" in info.value.details()
    assert len(info.value.details()) <= 1024
    trailers = tuple(info.value.trailing_metadata() or ())
    assert ("epd-field", "sampling.stop_token_ids") in trailers


def test_long_details_are_clipped_saying_how_long() -> None:
    assert clipped("short") == "short"
    long = clipped("x" * 5000)
    assert len(long) <= MAX_DETAILS and long.endswith("... (5000 characters)")


async def test_messages_the_processor_refuses_are_invalid_argument(cluster, workers):
    import numpy as np

    # A video whose frames differ in size (a system message after the first was refused
    # here too, until the template took it as a turn of its own).
    frames = [np.zeros((32, 32, 3), np.uint8), np.zeros((40, 32, 3), np.uint8)]
    bad = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 1.0}]}]
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(bad)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Named by the first frame of another size (s42 media review L4).
    assert err.value.details.startswith("messages[0].content[0].video.frames[1]: differs in size")


async def test_limits_refuse_before_any_worker_is_called(cluster, workers):
    enc, pre, dec = workers
    huge = [{"role": "user", "content": [{"type": "text", "text": "x" * 1_200_000}]}]
    attacks = {
        "sampling.max_tokens": (IMAGE, SamplingParams(max_tokens=2**32 - 1)),
        "messages[0].content[0].text": (huge, SamplingParams()),
    }
    for field, (messages, sampling) in attacks.items():
        with pytest.raises(GenerateError) as err:
            await cluster.client.generate_text(messages, sampling)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details.startswith(field)
    assert enc.requests == [] and pre.requests == [] and dec.requests == []


async def test_no_workers_is_unavailable(cluster):
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no prefill worker" in err.value.details


async def test_a_request_being_processed_counts_as_running(cluster, workers):
    # `vllm:num_requests_running` counts a request from its arrival: its processing (media
    # decoded, hashed) is part of it, not a gap where it shows nowhere.
    servicer = cluster.router.servicer
    prepare, entered, release = servicer._prepare, threading.Event(), threading.Event()

    def slow_prepare(*args):
        entered.set()
        release.wait(10)
        return prepare(*args)

    servicer._prepare = slow_prepare
    try:
        answer = asyncio.ensure_future(cluster.client.generate_text(TEXT))
        assert await asyncio.to_thread(entered.wait, 10)
        families = text_string_to_metric_families(
            generate_latest(cluster.router.orchestrator.metrics.registry).decode()
        )
        running = {s.name: s.value for f in families for s in f.samples}
        assert running["vllm:num_requests_running"] == 1
        release.set()
        await answer
    finally:
        release.set()
        servicer._prepare = prepare
    assert cluster.router.orchestrator.metrics.in_flight == 0


async def test_a_request_refused_after_its_media_were_processed_changes_no_cache(cluster, workers):
    # Past the context, or needing more KV blocks than a worker has, is found once the
    # media are processed (the prompt's length needs them): such refusals filled the
    # processed-image cache with every image and video patch they made (media review).
    cache = cluster.router.servicer.processor.image_cache
    video = {"type": "video", "video": [png(7), png(8), png(9), png(10)], "fps": 2.0}
    messages = chat({"type": "image", "image": png(6)}, video, {"type": "text", "text": "?"})
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(messages, SamplingParams(max_tokens=1 << 20))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for w in cluster.router.registry.workers():  # as if each KV worker had 2 blocks
        w.load.kv_blocks_free = 2
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(messages, SamplingParams(max_tokens=2))
    assert "KV blocks" in err.value.details
    assert (len(cache), cache.bytes_used) == (0, 0)
    for w in cluster.router.registry.workers():
        w.load.kv_blocks_free = 0  # unknown again
    await cluster.client.generate_text(messages, SamplingParams(max_tokens=2))
    assert len(cache) == 3 and cache.bytes_used > 0  # the image and two temporal patches


@pytest.mark.parametrize("shape", ["messages", "parts", "stop"])
async def test_a_request_of_many_tiny_elements_is_refused_without_holding_the_loop(
    cluster, workers, shape
):
    # 2 bytes an element on the wire: 524k empty messages in 1 MiB held the router's event
    # loop 1.4 s (parsed and counted there), 100 MiB of them 144 s, every worker's
    # heartbeat failing meanwhile (stalls review). Counted from the bytes, off the loop.
    element = {"messages": b"\x12\x00", "parts": b"\x12\x00", "stop": b"\x2a\x00"}[shape]
    body = element * (1 << 19)
    if shape == "parts":  # one message of them all
        inner = b"\x0a\x04user" + body
        body = b"\x12" + _varint(len(inner)) + inner
    async with loop_gaps() as gaps:
        channel = cluster.client._channels[0]  # its key; the request sent as raw bytes
        call = channel.unary_stream("/epd.v1.RouterService/Generate")(body)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    field = {"messages": "messages", "parts": "messages[0].content", "stop": "stop"}[shape]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    said = {"stop": f"stop: {TOO_MANY_STOPS}"}.get(shape, f"{field}: more than ")
    assert info.value.details().startswith(said)  # (stop: as `check_stop` words it)
    assert ("epd-field", field) in tuple(info.value.trailing_metadata() or ())
    assert max(gaps, default=0.0) < 0.5, gaps


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])
