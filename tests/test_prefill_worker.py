"""The prefill worker alone: validation, leases and their reaper, KV events, load reports.
In-process gRPC servers on 127.0.0.1 with real NIXL agents. Embeddings pulled by NIXL are in
tests/test_prefill_embeddings.py, settings and flags in tests/test_prefill_settings.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from common.engine import Engine
from common.kv.allocator import blocks_for
from common.server.role import RoleServer
from common.server.rpc import channel
from epd.v1 import (
    kv_pb2,
    multimodal_pb2,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    tensor_pb2,
)
from prefill_worker.server import serve as serve_prefill
from prefill_worker.service import MAX_LEASE_GROWTH
from prefill_worker.settings import PrefillSettings
from tests.cluster import cluster_credentials, cluster_security
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    IMAGE_VIDEO,
    TEXT,
    ckpt,
    engine,
    eventually,
    make_handoff,
    prefill_request,
    user,
)

__all__ = ["ckpt", "engine"]  # module fixtures shared with test_kv_handoff

pytestmark = pytest.mark.asyncio(loop_scope="module")

TTL_S = 0.6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(ckpt: Path) -> AsyncIterator[RoleServer[Any]]:
    """A prefill worker with a short lease TTL and a small cache (evictions happen)."""
    server = await serve_prefill(
        PrefillSettings(
            model=str(ckpt),
            block_size=BLOCK,
            num_blocks=48,
            lease_ttl_s=TTL_S,
            security=cluster_security(),
        )
    )
    yield server
    await server.stop(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(worker: RoleServer[Any]) -> AsyncIterator[Any]:
    async with channel(worker.address, credentials=cluster_credentials()) as ch:
        yield prefill_service_pb2_grpc.PrefillServiceStub(ch)


async def settle(worker: RoleServer[Any], stub: Any) -> None:
    """Release every live lease so block counts are at their baseline."""
    for lease in list(worker.servicer.leases._leases):
        await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=lease))
    await worker.servicer.settle_releases()  # the blocks go back after each answer
    assert worker.servicer.runner.allocator.pool.num_used_blocks == 0


# ------------------------------------------------------------------------- validation


def _corrupt_run_lengths(msg: multimodal_pb2.MultimodalParams, tokens: list[int]) -> None:
    msg.run_lengths[0] += 1


def _shift_runs(msg: multimodal_pb2.MultimodalParams, tokens: list[int]) -> None:
    for i in range(len(msg.run_positions)):
        msg.run_positions[i] += 1
    for i in range(len(msg.mm_positions)):
        msg.mm_positions[i] += 1


def _token_outside_vocab(msg: multimodal_pb2.MultimodalParams, tokens: list[int]) -> None:
    tokens[1] = 10**6


def _run_past_prompt(msg: multimodal_pb2.MultimodalParams, tokens: list[int]) -> None:
    del tokens[-40:]


def _narrow_embeddings(msg: multimodal_pb2.MultimodalParams, tokens: list[int]) -> None:
    for ref in (msg.embeddings[0].rows, *msg.embeddings[0].deepstack):
        ref.shape[1] -= 1
        ref.inline_data = ref.inline_data[: ref.shape[0] * ref.shape[1] * 4]


MALFORMED: dict[str, tuple[Callable[[Any, list[int]], None], str]] = {
    "run_lengths": (_corrupt_run_lengths, "run_lengths"),
    "placeholders_off_runs": (_shift_runs, "prompt_token_ids"),
    "token_outside_vocab": (_token_outside_vocab, "prompt_token_ids"),
    "run_past_prompt": (_run_past_prompt, "run_positions"),
    "embedding_width": (_narrow_embeddings, "embeddings.rows"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_handoff_is_invalid_argument_and_worker_keeps_serving(
    worker: RoleServer[Any], stub: Any, engine: Engine, case: str
) -> None:
    corrupt, field = MALFORMED[case]
    tokens, params = make_handoff(engine, IMAGE_VIDEO)
    request = prefill_request(tokens, params, GREEDY)
    bad_tokens = list(tokens)
    corrupt(request.multimodal, bad_tokens)
    del request.prompt_token_ids[:]
    request.prompt_token_ids.extend(bad_tokens)
    runner = worker.servicer.runner
    await settle(worker, stub)
    cached = runner.allocator.cached_hashes()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prefill(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")
    trailing = dict(info.value.trailing_metadata() or ())
    assert trailing.get("epd-field") == field
    assert runner.allocator.cached_hashes() == cached  # nothing cached from a rejected request
    assert runner.allocator.pool.num_used_blocks == 0
    # Still serving.
    text_tokens, text_params = make_handoff(engine, TEXT)
    reply = await stub.Prefill(prefill_request(text_tokens, text_params, GREEDY), timeout=30)
    await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id))


async def test_bad_sampling_is_invalid_argument(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    tokens, params = make_handoff(engine, TEXT)
    request = prefill_request(tokens, params, GREEDY)
    request.sampling.temperature = -1.0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prefill(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in (info.value.details() or "")


def _lora(request: prefill_service_pb2.PrefillRequest) -> None:
    request.lora_id = "adapter-that-is-not-loaded"


def _max_tokens(request: prefill_service_pb2.PrefillRequest) -> None:
    request.sampling.max_tokens = 2**32 - 1


def _int64_rows(request: prefill_service_pb2.PrefillRequest) -> None:
    rows = request.multimodal.embeddings[0].rows
    rows.dtype = tensor_pb2.ELEMENT_TYPE_INT64
    rows.inline_data = bytes(8 * rows.shape[0] * rows.shape[1])


@pytest.mark.parametrize(
    ("attack", "field"),
    [(_lora, "lora_id"), (_max_tokens, "sampling.max_tokens"), (_int64_rows, "embeddings.rows")],
)
async def test_hostile_requests_are_refused_before_any_block(
    worker: RoleServer[Any], stub: Any, engine: Engine, attack: Any, field: str
) -> None:
    tokens, params = make_handoff(engine, IMAGE_VIDEO)
    request = prefill_request(tokens, params, GREEDY)
    attack(request)
    runner = worker.servicer.runner
    await settle(worker, stub)
    cached, lookups = runner.allocator.cached_hashes(), runner.allocator.pool.lookups
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prefill(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")
    assert runner.allocator.cached_hashes() == cached
    assert runner.allocator.pool.lookups == lookups  # not even looked up
    assert runner.allocator.pool.num_used_blocks == 0


# ---------------------------------------------------------------------------- leases


async def test_release_frees_blocks_once(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    await settle(worker, stub)
    pool = worker.servicer.runner.allocator.pool
    tokens, params = make_handoff(engine, user("A short question about leases?"))
    reply = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    assert pool.num_used_blocks == blocks_for(len(tokens), BLOCK)
    release = prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id)
    assert (await stub.ReleaseKv(release)).released
    await worker.servicer.settle_releases()  # the blocks go back after the answer
    assert pool.num_used_blocks == 0
    assert not (await stub.ReleaseKv(release)).released
    pool.check_invariants()


async def test_release_answers_before_the_busy_model_thread_frees_the_blocks(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    """The answer needs only the lease table; the blocks go back once the model thread is
    free, and a second release of the lease is refused meanwhile."""
    await settle(worker, stub)
    servicer = worker.servicer
    pool = servicer.runner.allocator.pool
    tokens, params = make_handoff(engine, user("Another short question about leases?"))
    reply = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    gate = threading.Event()
    busy = asyncio.ensure_future(servicer.model.call(gate.wait, 30))  # a long forward
    release = prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id)
    try:
        assert (await asyncio.wait_for(stub.ReleaseKv(release), 10)).released
        assert pool.num_used_blocks == blocks_for(len(tokens), BLOCK)  # not freed yet
        assert not (await stub.ReleaseKv(release)).released
    finally:
        gate.set()
        await busy
    await servicer.settle_releases()
    assert pool.num_used_blocks == 0
    pool.check_invariants()


async def test_unreleased_lease_is_reaped_after_ttl(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    await settle(worker, stub)
    servicer = worker.servicer
    pool = servicer.runner.allocator.pool
    free = pool.num_free_blocks
    expired = servicer.leases.expired
    tokens, params = make_handoff(engine, user("Nobody will ever release this one."))
    reply = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    assert reply.kv.lease_ttl_ms == int(TTL_S * 1000)
    assert pool.num_free_blocks == free - blocks_for(len(tokens), BLOCK)
    await eventually(lambda: pool.num_free_blocks == free, timeout_s=TTL_S + 5)
    assert servicer.leases.expired == expired + 1
    assert len(servicer.leases) == 0
    release = prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id)
    assert not (await stub.ReleaseKv(release)).released
    pool.check_invariants()


async def test_a_lease_grows_with_those_live_up_to_ten_times_its_ttl(
    worker: RoleServer[Any], stub: Any, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unbounded, 2,000 leases on one cached prefix made the next last 30 + 1,000 s: a decode
    # worker that died then pinned its blocks ~17 minutes (clocks review, s36).
    await settle(worker, stub)
    monkeypatch.setattr(worker.servicer, "lease_ttl_per_lease_s", TTL_S / 4)
    tokens, params = make_handoff(engine, user("Leases that grow with the backlog?"))
    first = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    second = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    assert (first.kv.lease_ttl_ms, second.kv.lease_ttl_ms) == (600, 750)  # + 1/4 per live one
    monkeypatch.setattr(worker.servicer, "lease_ttl_per_lease_s", 1000.0)
    third = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    assert third.kv.lease_ttl_ms == int(MAX_LEASE_GROWTH * TTL_S * 1000)
    await settle(worker, stub)


# ------------------------------------------------------------------------- KV events


async def test_kv_events_snapshot_then_live(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    runner = worker.servicer.runner
    tokens, params = make_handoff(engine, user("Warm the cache with this sentence, please."))
    reply = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id))
    stream = stub.StreamKvEvents(prefill_service_pb2.StreamKvEventsRequest(subscriber="test"))
    try:
        snapshot = (await stream.read()).events
        assert len(snapshot) == 1
        assert snapshot[0].kind == kv_pb2.KV_EVENT_KIND_STORED
        assert list(snapshot[0].block_hashes) == runner.allocator.cached_hashes()
        assert set(reply.kv.block_hashes) <= set(snapshot[0].block_hashes)
        # Fill the small cache with new prompts: STORED for each, REMOVED once it evicts.
        stored: set[bytes] = set()
        removed: set[bytes] = set()
        sequence = snapshot[0].sequence
        for i in range(6):
            words = " ".join(f"word{i}x{j}" for j in range(30))
            t, p = make_handoff(engine, user(words))
            r = await stub.Prefill(prefill_request(t, p, GREEDY), timeout=30)
            await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=r.kv.lease_id))
            want = set(r.kv.block_hashes)
            while not want <= stored:
                for event in (await asyncio.wait_for(stream.read(), 10)).events:
                    assert event.sequence == sequence + 1
                    sequence = event.sequence
                    target = stored if event.kind == kv_pb2.KV_EVENT_KIND_STORED else removed
                    target.update(event.block_hashes)
        assert removed  # the 48-block cache evicted something
        cached = set(runner.allocator.cached_hashes())
        assert (stored | set(snapshot[0].block_hashes)) - removed == cached
    finally:
        stream.cancel()
    await eventually(lambda: worker.servicer.hub.subscribers == 0)


# ---------------------------------------------------------------------------------- load


async def test_load_reports_blocks_and_prefix_hits(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    await settle(worker, stub)
    tokens, params = make_handoff(engine, user("Count my prefix hits, twice over."))
    replies = [
        await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30) for _ in range(2)
    ]
    load = worker.servicer.load()
    pool = worker.servicer.runner.allocator.pool
    assert load.kv_blocks_used == pool.num_used_blocks > 0
    assert load.kv_blocks_free == pool.num_free_blocks
    assert load.cache_hits == pool.hits > 0
    assert load.cache_lookups == pool.lookups >= load.cache_hits
    assert replies[1].cached_tokens == (len(tokens) - 1) // BLOCK * BLOCK
    for reply in replies:
        await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id))
