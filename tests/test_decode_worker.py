"""The decode worker: refusing handles (tampered hashes, foreign layouts, malformed), freeing
blocks on cancel and deadline, a failed decode step (UNAVAILABLE, the worker goes on), the
first-token-only path, a stream of token ids only that never repeats the first token; plus
the runner's import plan without servers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from common.engine import Engine
from common.kv.allocator import blocks_for
from common.kv.block_pool import NoFreeBlocksError
from common.models.runner import LmRunner
from common.models.sequence import LmSequence
from common.sampling import SamplingParams
from common.settings.security import SecuritySettings
from decode_worker.__main__ import parse
from decode_worker.settings import DecodeSettings
from epd.v1 import decode_service_pb2, prefill_service_pb2
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    IMAGE_VIDEO,
    TEXT,
    Cluster,
    ckpt,
    decode_request,
    engine,
    eventually,
    make_handoff,
    resign,
    run_decode,
    run_prefill,
    start_cluster,
    stop_cluster,
    user,
    vid_part,
)

__all__ = ["ckpt", "engine"]  # module fixtures shared with test_kv_handoff

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(ckpt: Path, engine: Engine) -> AsyncIterator[Cluster]:
    c = await start_cluster(ckpt, engine)
    yield c
    await stop_cluster(c)


def snapshot(c: Cluster) -> tuple[list[bytes], int, int, int]:
    """Decode worker state a refused request must not change."""
    runner = c.decode.servicer.runner
    counters = c.decode.servicer.counters
    return (
        runner.allocator.cached_hashes(),
        runner.allocator.pool.num_free_blocks,
        counters.blocks_pulled,
        counters.blocks_reused,
    )


async def release(c: Cluster, lease_id: str) -> None:
    await c.prefill_stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=lease_id))


# -------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("where", ["first", "last"])
async def test_tampered_hash_is_refused_and_cache_unchanged(cluster: Cluster, where: str) -> None:
    c = cluster
    tokens, params = make_handoff(c.engine, IMAGE_VIDEO)
    reply = await run_prefill(c, tokens, params, GREEDY)
    request = decode_request(tokens, params, GREEDY, reply)
    index = 0 if where == "first" else len(request.kv.block_hashes) - 1
    request.kv.block_hashes[index] = bytes(32)
    resign(request)  # a signer's mistake: what decode checks past the signature
    before = snapshot(c)
    mismatches = c.decode.servicer.counters.hash_mismatches
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_hashes" in (info.value.details() or "")
    assert snapshot(c) == before
    assert c.decode.servicer.counters.hash_mismatches == mismatches + 1
    # The untampered handle still works (the lease was left alone).
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert answer.token_ids == c.expected(IMAGE_VIDEO, GREEDY).token_ids


async def test_handle_for_another_tenant_is_refused(cluster: Cluster) -> None:
    c = cluster
    tokens, params = make_handoff(c.engine, user("A prompt with enough words for some blocks."))
    reply = await run_prefill(c, tokens, params, GREEDY)
    before = snapshot(c)
    # Prefill hashed without a salt; this handoff claims a tenant salt: hashes differ.
    request = decode_request(tokens, params, GREEDY, reply)
    request.cache_salt = "another tenant"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert snapshot(c) == before
    await release(c, reply.kv.lease_id)


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", BLOCK * 2), ("model", "qwen3-vl/another"), ("num_layers", 99)],
)
async def test_foreign_layout_is_failed_precondition(
    cluster: Cluster, field: str, value: object
) -> None:
    c = cluster
    tokens, params = make_handoff(c.engine, TEXT)
    reply = await run_prefill(c, tokens, params, GREEDY)
    request = decode_request(tokens, params, GREEDY, reply)
    setattr(request.kv.layout, field, value)
    resign(request)
    before = snapshot(c)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv.layout" in (info.value.details() or "")
    assert field in (info.value.details() or "")
    assert snapshot(c) == before
    await release(c, reply.kv.lease_id)


async def test_malformed_requests_are_invalid_argument(cluster: Cluster) -> None:
    c = cluster
    tokens, params = make_handoff(c.engine, IMAGE_VIDEO)
    reply = await run_prefill(c, tokens, params, GREEDY)
    cases: dict[str, decode_service_pb2.DecodeRequest] = {}
    r = cases.setdefault("kv.num_tokens", decode_request(tokens, params, GREEDY, reply))
    r.kv.num_tokens += 1
    r = cases.setdefault("kv.blocks", decode_request(tokens, params, GREEDY, reply))
    del r.kv.blocks[-1]
    r = cases.setdefault("run_lengths", decode_request(tokens, params, GREEDY, reply))
    r.multimodal.run_lengths[0] -= 1
    r = cases.setdefault("first_token_id", decode_request(tokens, params, GREEDY, reply))
    r.first_token_id = -3
    r = cases.setdefault("kv", decode_request(tokens, params, GREEDY, reply))
    r.ClearField("kv")
    before = snapshot(c)
    for field, request in cases.items():
        if request.HasField("kv"):
            resign(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await run_decode(c, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in (info.value.details() or ""), info.value.details()
    assert snapshot(c) == before
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert answer.token_ids == c.expected(IMAGE_VIDEO, GREEDY).token_ids


# ---------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_cancelled_stream_frees_its_blocks(cluster: Cluster, how: str) -> None:
    c = cluster
    runner = c.decode.servicer.runner
    await eventually(lambda: runner.allocator.pool.num_used_blocks == 0)
    free = runner.allocator.pool.num_free_blocks
    long = SamplingParams(max_tokens=800, ignore_eos=True)
    tokens, params = make_handoff(c.engine, user(vid_part(31, 4), "Tell me a very long story."))
    reply = await run_prefill(c, tokens, params, long)
    request = decode_request(tokens, params, long, reply)
    if how == "cancel":
        call = c.decode_stub.Decode(request, timeout=60)
        first = await call.read()
        assert first.blocks_pulled == blocks_for(len(tokens), BLOCK)
        await call.read()
        assert runner.allocator.pool.num_used_blocks == blocks_for(len(tokens) + 800 - 1, BLOCK)
        call.cancel()
    else:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in c.decode_stub.Decode(request, timeout=0.5):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: runner.allocator.pool.num_used_blocks == 0)
    assert runner.allocator.pool.num_free_blocks == free
    runner.allocator.pool.check_invariants()
    # The prefill worker got its lease back too.
    await eventually(lambda: len(c.prefill.servicer.leases) == 0)


async def test_failed_decode_step_is_unavailable_and_the_worker_goes_on(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step that raises ends its streams with UNAVAILABLE (the router resumes them
    elsewhere) and gives their blocks back; the next request is answered as usual."""
    c = cluster
    runner = c.decode.servicer.runner
    real = runner.decode_step
    failed: list[bool] = []

    def fails_once(seqs: list[LmSequence]) -> None:
        if not failed:
            failed.append(True)
            raise MemoryError("no room to grow the running KV")
        real(seqs)

    monkeypatch.setattr(runner, "decode_step", fails_once)
    tokens, params = make_handoff(c.engine, TEXT)
    reply = await run_prefill(c, tokens, params, GREEDY)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode step failed: MemoryError: no room" in (info.value.details() or "")
    await eventually(lambda: runner.allocator.pool.num_used_blocks == 0)
    runner.allocator.pool.check_invariants()
    reply = await run_prefill(c, tokens, params, GREEDY)
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert answer.token_ids == c.expected(TEXT, GREEDY).token_ids
    await eventually(lambda: len(c.prefill.servicer.leases) == 0)


async def test_a_step_failed_while_the_lease_is_confirmed_says_the_kv_was_taken_first(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fails while the lease's release is confirmed ended the stream before its
    first chunk: the router read the lease as still its own, handed it to another worker
    (ABORTED kv.lease_id) and suspected the holder (kvimport review). The chunk saying the
    KV was taken comes first."""
    import asyncio

    c = cluster
    runner = c.decode.servicer.runner
    peers = c.decode.servicer.importer.peers
    confirm, go, failed = peers.confirm_release_kv, asyncio.Event(), list[bool]()

    async def confirmed_late(*args: object) -> object:
        answer = await confirm(*args)  # released on the holder
        await go.wait()
        return answer

    def fails(seqs: list[LmSequence]) -> None:
        failed.append(True)
        raise MemoryError("no room to grow the running KV")

    monkeypatch.setattr(peers, "confirm_release_kv", confirmed_late)
    monkeypatch.setattr(runner, "decode_step", fails)
    tokens, params = make_handoff(c.engine, TEXT)
    reply = await run_prefill(c, tokens, params, GREEDY)
    chunks: list[decode_service_pb2.DecodeResponse] = []

    async def stream() -> None:
        request = decode_request(tokens, params, GREEDY, reply)
        async for chunk in c.decode_stub.Decode(request, timeout=60):
            chunks.append(chunk)

    streaming = asyncio.create_task(stream())
    await eventually(lambda: bool(failed))
    go.set()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await streaming
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(chunks) == 1 and chunks[0].blocks_pulled > 0 and not chunks[0].token_ids
    await eventually(lambda: runner.allocator.pool.num_used_blocks == 0)
    await eventually(lambda: len(c.prefill.servicer.leases) == 0)


async def test_first_token_that_ends_the_answer_pulls_nothing(cluster: Cluster) -> None:
    c = cluster
    one = SamplingParams(max_tokens=1)
    tokens, params = make_handoff(c.engine, TEXT)
    reply = await run_prefill(c, tokens, params, one)
    pulled = c.decode.servicer.counters.blocks_pulled
    answer = await run_decode(c, decode_request(tokens, params, one, reply))
    assert answer.token_ids == [reply.first_token_id] == c.expected(TEXT, one).token_ids
    assert len(answer.chunks) == 1 and list(answer.chunks[0].token_ids) == []
    assert answer.chunks[0].finish_reason == decode_service_pb2.FINISH_REASON_LENGTH
    assert c.decode.servicer.counters.blocks_pulled == pulled
    await eventually(lambda: len(c.prefill.servicer.leases) == 0)


async def test_stream_is_token_ids_after_the_first(cluster: Cluster) -> None:
    c = cluster
    tokens, params = make_handoff(c.engine, TEXT)
    reply = await run_prefill(c, tokens, params, GREEDY)
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    head, *_ = answer.chunks
    assert head.blocks_pulled + head.blocks_reused == blocks_for(len(tokens), BLOCK)
    streamed = [t for ch in answer.chunks for t in ch.token_ids]
    assert streamed == c.expected(TEXT, GREEDY).token_ids[1:]  # the first token is not echoed
    assert answer.chunks[-1].finish_reason == decode_service_pb2.FINISH_REASON_LENGTH
    assert all(not ch.finish_reason for ch in answer.chunks[:-1])


async def test_stream_interval_sends_that_many_tokens_a_chunk(cluster: Cluster) -> None:
    """`stream_interval` 3: the same tokens, in chunks of three after the stream's first
    message (the lease confirmation), the last one shorter."""
    c = cluster
    batcher = c.decode.servicer.batcher
    tokens, params = make_handoff(c.engine, TEXT)
    reply = await run_prefill(c, tokens, params, GREEDY)
    batcher.stream_interval = 3
    try:
        answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    finally:
        batcher.stream_interval = 1
    streamed = [t for ch in answer.chunks for t in ch.token_ids]
    assert streamed == c.expected(TEXT, GREEDY).token_ids[1:]
    # (A stream read late takes the steps queued behind its chunk too: on a loaded machine
    # the whole answer came in the first message, none after it, CI load s45.)
    sizes = [len(ch.token_ids) for ch in answer.chunks[1:]]
    assert all(n % 3 == 0 for n in sizes[:-1]) and all(sizes)
    assert len(answer.chunks) <= 2 + len(streamed) // 3


async def test_load_and_counters(cluster: Cluster) -> None:
    servicer = cluster.decode.servicer
    load = servicer.load()
    assert load.kv_blocks_free == servicer.runner.allocator.pool.num_free_blocks
    assert load.kv_blocks_used == servicer.runner.allocator.pool.num_used_blocks
    assert load.cache_lookups >= load.cache_hits
    assert servicer.counters.bytes_pulled == servicer.counters.blocks_pulled * (
        servicer.runner.kv.spec.block_bytes
    )


# ------------------------------------------------------------------ without servers


@pytest.fixture(scope="module")
def runner(ckpt: Path) -> LmRunner:
    return LmRunner.from_pretrained(ckpt, block_size=4, num_blocks=12)


async def test_import_plan_reuses_cached_blocks_and_pulls_the_rest(runner: LmRunner) -> None:
    pool = runner.allocator.pool
    hashes = [bytes([i]) * 32 for i in range(3)]
    # Block for hash 1 cached (evictable), hashes 0 and 2 not.
    held = pool.allocate(1)
    pool.cache_block(held[0], hashes[1])
    pool.release(held)
    plan = runner.allocator.plan_import(hashes, num_tokens=14, total_tokens=20)  # 4 prompt blocks
    assert plan.reused == [1]
    assert plan.blocks[1] == held[0]
    assert plan.pull == [0, 2, 3]  # the missing full blocks + the partial last one
    assert len(plan.blocks) == blocks_for(20, 4)
    runner.allocator.finish_import(plan, hashes)
    assert set(runner.allocator.cached_hashes()) == set(hashes)
    runner.allocator.abort_import(plan)
    assert pool.num_used_blocks == 0
    # Too big: nothing taken.
    with pytest.raises(NoFreeBlocksError):
        runner.allocator.plan_import(hashes, num_tokens=14, total_tokens=100)
    assert pool.num_used_blocks == 0
    pool.check_invariants()
    pool.reset_prefix_cache()


async def test_uncacheable_import_pulls_everything_and_caches_nothing(runner: LmRunner) -> None:
    plan = runner.allocator.plan_import(None, num_tokens=9, total_tokens=9)
    assert plan.pull == [0, 1, 2] and plan.reused == []
    runner.allocator.finish_import(plan, None)
    assert runner.allocator.cached_hashes() == []
    runner.allocator.abort_import(plan)


async def test_flags(tmp_path: Path) -> None:
    config = tmp_path / "decode.toml"
    config.write_text("max_batch = 4\nnum_blocks = 64\n")
    settings = parse(["--config", str(config), "--block-size", "8", "--insecure"])
    assert settings == DecodeSettings(
        max_batch=4, num_blocks=64, block_size=8, security=SecuritySettings(insecure=True)
    )
    with pytest.raises(SystemExit):  # no cluster token and not --insecure
        parse(["--config", str(config)])
    assert parse(["--stream-interval", "4", "--insecure"]).stream_interval == 4
    assert parse(["--insecure"]).packed_weights is None  # where it pays (linear.use_packed)
    assert parse(["--packed-weights", "true", "--insecure"]).packed_weights is True
    assert parse(["--packed-weights", "false", "--insecure"]).packed_weights is False
    with pytest.raises(SystemExit):
        parse(["--stream-interval", "0", "--insecure"])
