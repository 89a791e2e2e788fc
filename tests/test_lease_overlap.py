"""The lease confirmation overlaps the first decode steps (`decode_worker.kv_import`), against
real prefill and decode workers over NIXL: while the holder's `ReleaseKv` answer is held back,
the sequence decodes, but the stream sends nothing and the pulled blocks stay out of the
prefix cache; once confirmed, the first chunk carries every token sampled meanwhile and the
answer equals the offline engine's. A lease found gone after steps ran fails with ABORTED,
leaving the cache and the pool as they were.

The answer is held back by gating the decode worker's own `confirm_release_kv` on an event
(fault injection through the real call; the holder still answers it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from common.engine import Engine
from common.kv.allocator import blocks_for
from common.sampling import SamplingParams
from epd.v1 import decode_service_pb2, prefill_service_pb2
from tests.test_kv_handoff import (
    BLOCK,
    Cluster,
    ckpt,
    decode_request,
    engine,
    eventually,
    img_part,
    make_handoff,
    run_prefill,
    start_cluster,
    stop_cluster,
    user,
)

__all__ = ["ckpt", "engine"]  # module fixtures shared with test_kv_handoff

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(ckpt: Path, engine: Engine) -> AsyncIterator[Cluster]:
    c = await start_cluster(ckpt, engine)
    yield c
    await stop_cluster(c)


@pytest.fixture
def gate(cluster: Cluster) -> Iterator[asyncio.Event]:
    """Hold the decode worker's lease confirmations until the event is set."""
    peers = cluster.decode.servicer.importer.peers
    original = peers.confirm_release_kv
    opened = asyncio.Event()

    async def gated(*args: object, **kwargs: object) -> bool:
        await opened.wait()
        return await original(*args, **kwargs)

    peers.confirm_release_kv = gated
    yield opened
    opened.set()
    peers.confirm_release_kv = original


async def prefilled(c: Cluster, messages: object) -> decode_service_pb2.DecodeRequest:
    """The Decode request of `messages`, prefilled (its lease held on the prefill worker)."""
    tokens, params = make_handoff(c.engine, messages)
    reply = await run_prefill(c, tokens, params, TOKENS)
    return decode_request(tokens, params, TOKENS, reply)


async def test_steps_run_while_confirming_but_nothing_leaves_before(
    cluster: Cluster, gate: asyncio.Event
) -> None:
    c = cluster
    servicer = c.decode.servicer
    allocator = servicer.runner.allocator
    messages = user(img_part(300), "What is in this picture, in a few words?")
    request = await prefilled(c, messages)
    blocks = blocks_for(len(request.prompt_token_ids), BLOCK)
    got: list[decode_service_pb2.DecodeResponse] = []

    async def read() -> None:
        async for chunk in c.decode_stub.Decode(request, timeout=60):
            got.append(chunk)

    steps = servicer.batcher.steps
    reader = asyncio.create_task(read())
    # The whole answer is sampled (the sequence even leaves the loop) before the holder's
    # answer comes: nothing streamed, nothing cached, the pulled blocks still held.
    await eventually(lambda: servicer.batcher.steps >= steps + TOKENS.max_tokens - 1)
    await eventually(lambda: servicer.batcher.running == 0)
    assert got == []
    assert not set(request.kv.block_hashes) & set(allocator.cached_hashes())
    assert allocator.pool.num_used_blocks == blocks
    gate.set()
    await asyncio.wait_for(reader, 30)
    head = got[0]
    assert head.blocks_pulled == blocks
    assert len(head.token_ids) == TOKENS.max_tokens - 1  # everything sampled meanwhile
    streamed = [request.first_token_id, *(t for ch in got for t in ch.token_ids)]
    assert streamed == c.expected(messages, TOKENS).token_ids
    assert got[-1].finish_reason == decode_service_pb2.FINISH_REASON_LENGTH
    await eventually(lambda: allocator.pool.num_used_blocks == 0)
    allocator.pool.check_invariants()
    assert set(request.kv.block_hashes) <= set(allocator.cached_hashes())


async def test_lease_gone_after_steps_ran_is_aborted_and_leaves_nothing(
    cluster: Cluster, gate: asyncio.Event
) -> None:
    c = cluster
    servicer = c.decode.servicer
    allocator = servicer.runner.allocator
    await eventually(lambda: allocator.pool.num_used_blocks == 0)
    request = await prefilled(c, user(img_part(301), "And this one, briefly?"))
    cached, free = allocator.cached_hashes(), allocator.pool.num_free_blocks
    lost = servicer.counters.leases_lost
    pulled, read = servicer.counters.blocks_pulled, servicer.counters.bytes_pulled
    steps = servicer.batcher.steps
    call = c.decode_stub.Decode(request, timeout=60)
    reader = asyncio.create_task(call.read())
    await eventually(lambda: servicer.batcher.steps >= steps + 2)
    # The lease ends on the holder before its answer to the decode worker is read.
    release = prefill_service_pb2.ReleaseKvRequest(lease_id=request.kv.lease_id)
    await c.prefill_stub.ReleaseKv(release)
    gate.set()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(reader, 30)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "kv.lease_id" in (info.value.details() or "")
    assert servicer.counters.leases_lost == lost + 1
    # Its READ counts in the network's figures (bytes, seconds), not as blocks used.
    assert servicer.counters.bytes_pulled > read and servicer.counters.blocks_pulled == pulled
    assert allocator.cached_hashes() == cached
    assert allocator.pool.num_free_blocks == free
    allocator.pool.check_invariants()
