"""The router's failover paths against fake workers in this event loop (`tests.test_router`):
a decode stream that breaks mid-way resumes on another decode worker with `resume_tokens`,
and fails with UNAVAILABLE naming the role when resuming finds no prefill worker left.
Prefill failures: `tests.test_failover_prefill`; a worker's error as the client sees it:
`tests.test_worker_errors`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.errors import DECODE_STEP_FAILED
from common.roles import Role
from common.sampling import SamplingParams
from epd.client import GenerateError
from epd.v1 import decode_service_pb2
from tests import test_router
from tests.test_router import (
    FIRST,
    TEXT,
    FakeDecode,
    FakeEncoder,
    FakePrefill,
    chat,
    png,
    prompt_hashes,
)

# The router plus fake workers in this event loop, as in `tests.test_router`.
ckpt = test_router.ckpt


@pytest.fixture
async def cluster(ckpt):
    # These tests count the Encode calls a retry makes: the outputs the router keeps
    # (`embedding_cache_mb`) would answer them without one.
    c = await test_router.start_router(ckpt, embedding_cache_mb=0)
    yield c
    await c.close()


class BreakingDecode(FakeDecode):
    """Streams the tokens after `resume_tokens` (101, 102, ... by position), and breaks the
    stream with UNAVAILABLE after `break_after` of them (None: never; `fresh_only`: only a
    stream that is not itself resumed), as a killed worker."""

    def __init__(self, break_after: int | None, *, fresh_only: bool = False) -> None:
        super().__init__()
        self.break_after = break_after
        self.fresh_only = fresh_only

    async def Decode(self, request, context):
        self.requests.append(request)
        done = 1 + len(request.resume_tokens)  # tokens the client already has
        yield decode_service_pb2.DecodeResponse(blocks_pulled=3)
        breaks = self.break_after is not None and not (self.fresh_only and request.resume_tokens)
        for sent, n in enumerate(range(done, request.sampling.max_tokens)):
            if breaks and sent == self.break_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")
            last = n == request.sampling.max_tokens - 1
            yield decode_service_pb2.DecodeResponse(
                token_ids=[100 + n],
                finish_reason=decode_service_pb2.FINISH_REASON_LENGTH if last else 0,
            )


async def test_a_broken_decode_stream_resumes_on_another_worker(cluster):
    enc, pre = FakeEncoder(), FakePrefill()
    decoders = [BreakingDecode(3, fresh_only=True) for _ in range(2)]
    await cluster.add(Role.ENCODER, enc)
    await cluster.add(Role.PREFILL, pre)
    for decode in decoders:
        await cluster.add(Role.DECODE, decode)
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    # One uninterrupted stream: nothing repeated, nothing missing.
    assert result.token_ids == [FIRST, *range(101, 110)]
    assert result.finish_reason == "length"
    (broken,) = [r for d in decoders for r in d.requests if not r.resume_tokens]
    (resumed,) = [r for d in decoders for r in d.requests if r.resume_tokens]
    assert [len(d.requests) for d in decoders] == [1, 1]  # on the other worker
    assert list(broken.resume_tokens) == []
    assert list(resumed.resume_tokens) == [101, 102, 103]  # what the client had after FIRST
    assert resumed.first_token_id == FIRST
    # The prompt was prefilled again for a fresh handle under a new lease.
    assert [r.kv.lease_id for r in (broken, resumed)] == ["lease-1", "lease-2"]
    assert len(pre.requests) == 2
    metrics = cluster.router.orchestrator.metrics
    assert metrics.migrations._value.get() == 1
    assert metrics.tokens_recomputed._value.get() == 3


async def test_a_stream_with_no_worker_to_resume_on_counts_no_migration(cluster):
    # The counters went up before another worker was looked for: with the only decode
    # worker gone, the dashboard showed streams migrated and tokens recomputed while every
    # client got UNAVAILABLE.
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, FakePrefill())
    await cluster.add(Role.DECODE, BreakingDecode(3, fresh_only=True))
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    metrics = cluster.router.orchestrator.metrics
    assert metrics.migrations._value.get() == 0
    assert metrics.tokens_recomputed._value.get() == 0
    assert cluster.router.orchestrator.calls.retries["decode"] == 0


class StepFailingDecode(BreakingDecode):
    """A decode worker whose step fails once, `break_after` tokens into its first stream: it
    ends that stream with UNAVAILABLE naming the failed step, as `DecodeStepError` does, and
    serves every stream after (it did not die)."""

    async def Decode(self, request, context):
        if self.break_after is None:
            async for response in super().Decode(request, context):
                yield response
            return
        self.requests.append(request)
        yield decode_service_pb2.DecodeResponse(blocks_pulled=3)
        done = 1 + len(request.resume_tokens)
        for n in range(done, done + self.break_after):
            yield decode_service_pb2.DecodeResponse(token_ids=[100 + n])
        self.break_after = None
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{DECODE_STEP_FAILED}: MemoryError: x")


async def test_a_failed_step_resumes_on_the_same_worker_when_it_is_the_only_one(cluster):
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, FakePrefill())
    decode = StepFailingDecode(3)
    await cluster.add(Role.DECODE, decode)
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    # It was tried again although it had failed this stream: a failed step is not a dead
    # worker. One uninterrupted answer: nothing repeated, nothing missing.
    assert result.token_ids == [FIRST, *range(101, 110)]
    assert [list(r.resume_tokens) for r in decode.requests] == [[], [101, 102, 103]]


class AlwaysStepFailingDecode(BreakingDecode):
    """A decode worker whose every stream's step fails after one token (it serves on)."""

    async def Decode(self, request, context):
        self.requests.append(request)
        yield decode_service_pb2.DecodeResponse(blocks_pulled=3)
        yield decode_service_pb2.DecodeResponse(token_ids=[101 + len(request.resume_tokens)])
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{DECODE_STEP_FAILED}: MemoryError: x")


async def test_a_failed_step_resumes_on_another_worker_when_there_is_one(cluster):
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, FakePrefill())
    bad, good = AlwaysStepFailingDecode(None), BreakingDecode(None)
    await cluster.add(Role.DECODE, bad)
    await cluster.add(Role.DECODE, good)
    for _ in range(3):
        result = await cluster.client.generate_text(
            TEXT, SamplingParams(max_tokens=10), timeout_s=20
        )
        assert result.token_ids == [FIRST, *range(101, 110)]
    # Each stream that started on the failing worker went on on the healthy one, never
    # back to the worker that had just failed it.
    assert all(list(r.resume_tokens) == [] for r in bad.requests)
    assert len(good.requests) == 3


async def test_failed_steps_are_bounded_on_the_only_worker(cluster):
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, FakePrefill())
    decode = AlwaysStepFailingDecode(None)
    await cluster.add(Role.DECODE, decode)
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert DECODE_STEP_FAILED in err.value.details
    assert len(decode.requests) == 3  # the first stream and two resumes


class FirstStepFailingDecode(BreakingDecode):
    """A decode worker whose first stream fails its first step, before any answer (the
    router still holds the KV handle), and that serves every stream after."""

    async def Decode(self, request, context):
        if not self.requests:
            self.requests.append(request)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{DECODE_STEP_FAILED}: x")
        async for response in super().Decode(request, context):
            yield response


async def test_a_first_step_failed_before_any_answer_is_tried_elsewhere_without_migrations(
    ckpt,
):
    # No migrations allowed: no stream may resume. But nothing was streamed yet and the
    # router still holds the handle, so another worker is tried as for any refusal.
    cluster = await test_router.start_router(ckpt, embedding_cache_mb=0, decode_migrations=0)
    try:
        await cluster.add(Role.ENCODER, FakeEncoder())
        await cluster.add(Role.PREFILL, FakePrefill())
        failing, healthy = FirstStepFailingDecode(None), BreakingDecode(None)
        await cluster.add(Role.DECODE, failing)
        await cluster.add(Role.DECODE, healthy)
        for _ in range(2):
            result = await cluster.client.generate_text(
                TEXT, SamplingParams(max_tokens=10), timeout_s=20
            )
            assert result.token_ids == [FIRST, *range(101, 110)]
        assert len(failing.requests) >= 1 and healthy.requests
    finally:
        await cluster.close()


async def test_migrations_are_bounded(cluster):
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, FakePrefill())
    for _ in range(4):  # more workers than the two migrations allowed
        await cluster.add(Role.DECODE, BreakingDecode(break_after=1))
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.details.startswith("decode failed")
    # The workers' addresses are the operator's to know (docs/security.md), not a client's.
    assert "127.0.0.1" not in err.value.details


async def test_a_reserved_decode_worker_turned_suspect_is_passed_over(cluster):
    # Admission reserved it; a call on it failed before this request's decode (frozen):
    # the request goes to another decode worker rather than wait on a reconnect.
    registry = cluster.router.registry

    class Marking(FakePrefill):
        async def Prefill(self, request, context):
            reserved = min(registry.workers(Role.DECODE), key=lambda w: w.address)
            registry.suspect(reserved)  # the one the first request reserved (ties: address)
            return await super().Prefill(request, context)

    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, Marking())
    decoders = {}
    for _ in range(2):
        decode = BreakingDecode(None)
        decoders[await cluster.add(Role.DECODE, decode)] = decode
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert result.token_ids == [FIRST, 101, 102, 103]
    low, high = sorted(decoders)
    assert len(decoders[low].requests) == 0 and len(decoders[high].requests) == 1


class LastPrefill(FakePrefill):
    """Serves one call, then is drained (`drain`, as an operator's Drain would)."""

    def __init__(self, drain) -> None:
        super().__init__()
        self.drain = drain

    async def Prefill(self, request, context):
        response = await super().Prefill(request, context)
        self.drain(self.address)
        return response


async def test_a_broken_stream_with_no_prefill_worker_left_is_unavailable(cluster):
    """Resuming needs a prefill (a fresh handle); with none left the client gets UNAVAILABLE
    naming the role, as for a request that finds none, not an internal error."""
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, LastPrefill(cluster.router.registry.drain))
    for _ in range(2):
        await cluster.add(Role.DECODE, BreakingDecode(2, fresh_only=True))
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no prefill worker is registered and available" in err.value.details


async def test_a_resumed_multimodal_stream_is_not_encoded_again_when_prefill_holds_it(cluster):
    enc, pre = FakeEncoder(), FakePrefill()
    decoders = [BreakingDecode(2, fresh_only=True) for _ in range(2)]
    messages = chat({"type": "image", "image": png(4)}, {"type": "text", "text": "And now?"})
    _, hashes = prompt_hashes(cluster, messages)
    pre.cached = hashes  # the prefill worker holds the prompt's blocks (its KV events)
    await cluster.add(Role.ENCODER, enc)
    await cluster.add(Role.PREFILL, pre)
    for decode in decoders:
        await cluster.add(Role.DECODE, decode)
    await asyncio.sleep(0.3)  # the router follows the worker's KV events
    result = await cluster.client.generate_text(messages, SamplingParams(max_tokens=8))
    assert result.token_ids == [FIRST, *range(101, 108)]
    assert len(pre.requests) == 2  # prefilled again for the resumed stream
    assert enc.requests == []  # the image lies inside the cached prefix, both times
    assert [len(r.multimodal.embeddings) for r in pre.requests] == [0, 0]


class EndingDecode(BreakingDecode):
    """Ends a fresh stream after `break_after` tokens with status OK but no finish reason,
    as no real worker should: a truncated answer that looks complete."""

    async def Decode(self, request, context):
        self.requests.append(request)
        done = 1 + len(request.resume_tokens)
        yield decode_service_pb2.DecodeResponse(blocks_pulled=3)
        for sent, n in enumerate(range(done, request.sampling.max_tokens)):
            if sent == self.break_after and not request.resume_tokens:
                return
            last = n == request.sampling.max_tokens - 1
            yield decode_service_pb2.DecodeResponse(
                token_ids=[100 + n],
                finish_reason=decode_service_pb2.FINISH_REASON_LENGTH if last else 0,
            )


async def test_a_decode_stream_that_ends_without_a_finish_reason_is_resumed(cluster):
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, FakePrefill())
    decoders = [EndingDecode(3) for _ in range(2)]
    for decode in decoders:
        await cluster.add(Role.DECODE, decode)
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    # Not a 4-token answer passed off as whole: resumed on the other worker, to the end.
    assert result.token_ids == [FIRST, *range(101, 110)]
    assert result.finish_reason == "length"
    assert [len(d.requests) for d in decoders] == [1, 1]


async def test_a_decode_stream_that_keeps_ending_early_is_an_error(cluster):
    await cluster.add(Role.ENCODER, FakeEncoder())
    await cluster.add(Role.PREFILL, FakePrefill())
    await cluster.add(Role.DECODE, EndingDecode(2))  # one worker: nowhere to resume
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=10), timeout_s=20)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE  # as for a stream that broke
    assert "no decode worker left" in str(err.value)
