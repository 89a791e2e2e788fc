"""Bytes bound to keys (DESIGN §4), against real prefill and decode workers over NIXL: forged
or tampered handles are refused before anything is pulled or cached, a lease that ran out
before the READ was confirmed discards what was read, a block whose bytes changed in the
holder's buffer is caught by its digest (and recomputed), and the partial last block is
covered by the prompt digest. After every refusal an honest request for the same prompt
reuses nothing from it and answers as the offline engine does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch

from common.engine import Engine
from common.errors import LEASE_NOT_LIVE
from common.kv.allocator import blocks_for
from common.transfer.agent import TransferAgent
from epd.v1 import decode_service_pb2, prefill_service_pb2
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    Cluster,
    ckpt,
    decode_request,
    engine,
    eventually,
    img_part,
    make_handoff,
    resign,
    run_decode,
    run_prefill,
    start_cluster,
    stop_cluster,
    user,
)

__all__ = ["ckpt", "engine"]  # module fixtures shared with test_kv_handoff

pytestmark = pytest.mark.asyncio(loop_scope="module")

Forge = Callable[[decode_service_pb2.DecodeRequest], None]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(ckpt: Path, engine: Engine) -> AsyncIterator[Cluster]:
    c = await start_cluster(ckpt, engine, lease_ttl_s=3.0)
    yield c
    await stop_cluster(c)


@pytest.fixture(scope="module")
def junk() -> Iterator[tuple[TransferAgent, torch.Tensor]]:
    """Another live NIXL agent, holding a registered buffer of junk."""
    agent = TransferAgent("junk")
    buffer = torch.full((4 << 20,), 0x5A, dtype=torch.uint8)
    agent.register(buffer)
    yield agent, buffer
    agent.close()


def state(c: Cluster) -> tuple[list[bytes], int, int]:
    """What a refused request must leave unchanged on the decode worker."""
    runner = c.decode.servicer.runner
    return (
        runner.allocator.cached_hashes(),
        runner.allocator.pool.num_free_blocks,
        c.decode.servicer.counters.blocks_pulled,
    )


def prompt(n: int) -> list[dict[str, object]]:
    """A fresh prompt per case (nothing of it cached anywhere yet), several blocks long."""
    return user(img_part(100 + n), f"Case {n}: tell me what you see, in a few words.")


async def assert_honest_answer_reuses_nothing(c: Cluster, messages: object) -> None:
    """A fresh prefill + decode of `messages`: pulls every block (nothing of a refused
    attempt entered the decode cache) and answers as the offline engine."""
    tokens, params = make_handoff(c.engine, messages)
    reply = await run_prefill(c, tokens, params, GREEDY)
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert answer.chunks[0].blocks_reused == 0
    assert answer.chunks[0].blocks_pulled == blocks_for(len(tokens), BLOCK)
    assert answer.token_ids == c.expected(messages, GREEDY).token_ids


def other_blocks(r: decode_service_pb2.DecodeRequest) -> None:
    """Point every descriptor at another block of the holder's buffer."""
    for b in r.kv.blocks:
        b.address += b.length * 7


def lease_that_does_not_exist(r: decode_service_pb2.DecodeRequest) -> None:
    r.kv.lease_id = "0" * 32


def holder_that_is_not_a_prefill_worker(r: decode_service_pb2.DecodeRequest) -> None:
    r.kv.holder_address = "127.0.0.1:9"


def no_signature(r: decode_service_pb2.DecodeRequest) -> None:
    r.kv.ClearField("signature")


# --------------------------------------------------------------- forged handles


FORGERIES = [other_blocks, lease_that_does_not_exist, holder_that_is_not_a_prefill_worker]


@pytest.mark.parametrize("case", range(len(FORGERIES) + 1))
async def test_forged_handle_is_refused_unsigned(cluster: Cluster, case: int) -> None:
    c = cluster
    forge = (*FORGERIES, no_signature)[case]
    messages = prompt(case)
    tokens, params = make_handoff(c.engine, messages)
    reply = await run_prefill(c, tokens, params, GREEDY)
    request = decode_request(tokens, params, GREEDY, reply)
    forge(request)
    before = state(c)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "kv.signature" in (info.value.details() or "")
    assert state(c) == before
    await c.prefill_stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id))
    await assert_honest_answer_reuses_nothing(c, messages)


async def test_metadata_of_another_live_agent_is_refused(
    cluster: Cluster, junk: tuple[TransferAgent, torch.Tensor]
) -> None:
    c = cluster
    agent, buffer = junk
    messages = prompt(10)
    tokens, params = make_handoff(c.engine, messages)
    reply = await run_prefill(c, tokens, params, GREEDY)
    request = decode_request(tokens, params, GREEDY, reply)
    request.kv.agent_metadata = agent.metadata()
    request.kv.agent_name = agent.name
    for i, b in enumerate(request.kv.blocks):  # into the junk buffer
        b.address = buffer.data_ptr() + i * b.length
    before = state(c)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert state(c) == before
    # Even signed (a signer's bug or a stolen key), junk bytes fail their digests.
    resign(request)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "kv.block_digests" in (info.value.details() or "")
    assert state(c)[0] == before[0] and state(c)[1] == before[1]
    await assert_honest_answer_reuses_nothing(c, messages)


async def test_signed_handle_to_other_blocks_fails_the_digests(cluster: Cluster) -> None:
    c = cluster
    messages = prompt(11)
    tokens, params = make_handoff(c.engine, messages)
    reply = await run_prefill(c, tokens, params, GREEDY)
    request = resign_after(decode_request(tokens, params, GREEDY, reply), other_blocks)
    before = state(c)
    mismatches = c.decode.servicer.counters.digest_mismatches
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert c.decode.servicer.counters.digest_mismatches > mismatches
    assert state(c)[:2] == before[:2]
    # The holder re-checked its own blocks: they are intact, so nothing left its cache.
    assert c.prefill.servicer.runner.allocator.digest_mismatches == 0
    await assert_honest_answer_reuses_nothing(c, messages)


def resign_after(
    request: decode_service_pb2.DecodeRequest, forge: Forge
) -> decode_service_pb2.DecodeRequest:
    forge(request)
    return resign(request)


# --------------------------------------------------------------------- leases


async def test_signed_unknown_lease_discards_what_was_read(cluster: Cluster) -> None:
    c = cluster
    messages = prompt(12)
    tokens, params = make_handoff(c.engine, messages)
    reply = await run_prefill(c, tokens, params, GREEDY)
    request = resign_after(decode_request(tokens, params, GREEDY, reply), lease_that_does_not_exist)
    before = state(c)
    lost = c.decode.servicer.counters.leases_lost
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "kv.lease_id" in (info.value.details() or "")
    assert c.decode.servicer.counters.leases_lost == lost + 1
    assert state(c)[:2] == before[:2]
    await c.prefill_stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id))
    await assert_honest_answer_reuses_nothing(c, messages)


async def test_expired_lease_whose_blocks_were_reused_is_not_served(cluster: Cluster) -> None:
    """The measured failure: a lease runs out while its request waits, the prefill worker
    reuses the blocks for other prompts, then decode READs them. Now the READ does not count
    and nothing of it is cached."""
    c = cluster
    messages = prompt(13)
    tokens, params = make_handoff(c.engine, messages)
    reply = await run_prefill(c, tokens, params, GREEDY)
    leases = c.prefill.servicer.leases
    expired = leases.expired
    await eventually(lambda: leases.expired > expired, timeout_s=15)
    # Other prompts take the freed blocks (the pool hands out free blocks first, so fill it).
    pool = c.prefill.servicer.runner.allocator.pool
    fillers: list[prefill_service_pb2.PrefillResponse] = []
    while pool.num_free_blocks > 4 * blocks_for(len(tokens), BLOCK) and len(fillers) < 80:
        t, p = make_handoff(c.engine, user(f"filler {len(fillers)} " * 12))
        fillers.append(await run_prefill(c, t, p, GREEDY))
    before = state(c)
    mismatches = c.decode.servicer.counters.digest_mismatches
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert state(c)[:2] == before[:2]
    # The holder says the lease was gone: no corruption counted, nor the holder blamed (its
    # words keep the router from suspecting it: chaos review, s37).
    assert LEASE_NOT_LIVE in (info.value.details() or "")
    assert c.decode.servicer.counters.digest_mismatches == mismatches
    for f in fillers:
        await c.prefill_stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=f.kv.lease_id))
    await assert_honest_answer_reuses_nothing(c, messages)


async def test_renew_keeps_a_live_lease_and_refuses_a_gone_one(cluster: Cluster) -> None:
    c = cluster
    tokens, params = make_handoff(c.engine, prompt(14))
    reply = await run_prefill(c, tokens, params, GREEDY)
    renewed = await c.prefill_stub.RenewKv(
        prefill_service_pb2.RenewKvRequest(lease_id=reply.kv.lease_id)
    )
    assert renewed.renewed and renewed.lease_ttl_ms > 0
    done = await c.prefill_stub.ReleaseKv(
        prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id)
    )
    assert done.released
    again = await c.prefill_stub.ReleaseKv(
        prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id)
    )
    assert not again.released
    gone = await c.prefill_stub.RenewKv(
        prefill_service_pb2.RenewKvRequest(lease_id=reply.kv.lease_id)
    )
    assert not gone.renewed


# -------------------------------------------------------------------- digests


async def test_block_corrupted_in_the_holder_is_caught_and_recomputed(cluster: Cluster) -> None:
    c = cluster
    messages = prompt(15)
    tokens, params = make_handoff(c.engine, messages)
    holder = c.prefill.servicer.runner
    first = await run_prefill(c, tokens, params, GREEDY)
    await c.prefill_stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=first.kv.lease_id))
    # The second prefill reuses the cached prefix; corrupt one of its blocks after commit.
    reply = await run_prefill(c, tokens, params, GREEDY)
    assert reply.cached_tokens > 0
    victim = holder.allocator.pool.get(reply.kv.block_hashes[0])
    assert victim is not None
    holder.kv.buffer[victim].view(-1)[5] += 1.0
    before = state(c)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "kv.block_digests" in (info.value.details() or "")
    assert state(c)[:2] == before[:2]
    # The holder checked the block itself, found it changed and dropped it from its cache:
    # the next prefill recomputes it, and the answer is the offline engine's.
    await eventually(lambda: holder.allocator.digest_mismatches >= 1)
    assert holder.allocator.pool.get(reply.kv.block_hashes[0]) is None
    again = await run_prefill(c, tokens, params, GREEDY)
    assert again.cached_tokens == 0
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, again))
    assert answer.token_ids == c.expected(messages, GREEDY).token_ids


async def test_prefill_never_reuses_a_corrupted_cached_block(cluster: Cluster) -> None:
    c = cluster
    messages = prompt(16)
    tokens, params = make_handoff(c.engine, messages)
    holder = c.prefill.servicer.runner
    first = await run_prefill(c, tokens, params, GREEDY)
    await c.prefill_stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=first.kv.lease_id))
    victim = holder.allocator.pool.get(first.kv.block_hashes[1])
    assert victim is not None
    holder.kv.buffer[victim].view(-1)[-1] = 1e9
    mismatches = holder.allocator.digest_mismatches
    reply = await run_prefill(c, tokens, params, GREEDY)
    assert holder.allocator.digest_mismatches == mismatches + 1
    assert reply.cached_tokens == BLOCK  # block 0 reused; block 1 (corrupt) recomputed
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert answer.token_ids == c.expected(messages, GREEDY).token_ids


async def test_decode_never_reuses_a_corrupted_cached_block(cluster: Cluster) -> None:
    c = cluster
    messages = prompt(19)
    tokens, params = make_handoff(c.engine, messages)
    runner = c.decode.servicer.runner
    first = await run_prefill(c, tokens, params, GREEDY)
    await run_decode(c, decode_request(tokens, params, GREEDY, first))
    full = len(tokens) // BLOCK
    # The decode worker cached the pulled blocks once the lease was confirmed; one of them
    # changes afterwards (a stray write, say).
    await eventually(lambda: runner.allocator.pool.get(first.kv.block_hashes[1]) is not None)
    victim = runner.allocator.pool.get(first.kv.block_hashes[1])
    assert victim is not None
    runner.kv.buffer[victim].view(-1)[3] += 1.0
    mismatches = runner.allocator.digest_mismatches
    again = await run_prefill(c, tokens, params, GREEDY)
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, again))
    # Found changed before reuse: uncached, counted, and pulled again with the rest.
    assert runner.allocator.digest_mismatches == mismatches + 1
    assert answer.chunks[0].blocks_reused == full - 1
    assert answer.chunks[0].blocks_pulled == blocks_for(len(tokens), BLOCK) - (full - 1)
    assert answer.token_ids == c.expected(messages, GREEDY).token_ids


# -------------------------------------------------------------- the partial block


async def test_handoff_whose_partial_last_block_differs_is_refused(cluster: Cluster) -> None:
    c = cluster
    messages = prompt(17)
    tokens, params = make_handoff(c.engine, messages)
    assert len(tokens) % BLOCK, "the prompt must end in a partial block"
    reply = await run_prefill(c, tokens, params, GREEDY)
    changed = [*tokens[:-1], (tokens[-1] + 1) % 1000]
    request = decode_request(changed, params, GREEDY, reply)
    assert list(request.kv.block_hashes) == list(reply.kv.block_hashes)  # full blocks agree
    before = state(c)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_decode(c, request)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv.prompt_digest" in (info.value.details() or "")
    assert state(c) == before
    answer = await run_decode(c, decode_request(tokens, params, GREEDY, reply))
    assert answer.token_ids == c.expected(messages, GREEDY).token_ids


async def test_cancelled_during_the_confirmation_frees_everything(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster
    runner = c.decode.servicer.runner
    await eventually(lambda: runner.allocator.pool.num_used_blocks == 0)
    tokens, params = make_handoff(c.engine, prompt(18))
    reply = await run_prefill(c, tokens, params, GREEDY)
    # The confirmation of the READ waits until the request is cancelled (cancelled at once,
    # as this test was, the call never reached the READ: the lease ran out its TTL instead).
    peers = c.decode.servicer.importer.peers
    confirm, asked, gate = peers.confirm_release_kv, asyncio.Event(), asyncio.Event()

    async def held_confirm(*args: Any) -> Any:
        asked.set()
        await gate.wait()
        return await confirm(*args)

    monkeypatch.setattr(peers, "confirm_release_kv", held_confirm)
    leases = c.prefill.servicer.leases
    released, expired = leases.released, leases.expired
    call = c.decode_stub.Decode(decode_request(tokens, params, GREEDY, reply), timeout=60)
    await asyncio.wait_for(asked.wait(), 10)  # READ, and its confirmation under way
    call.cancel()
    await eventually(lambda: c.decode.servicer.active == 0)  # the worker saw it go
    gate.set()
    await eventually(lambda: runner.allocator.pool.num_used_blocks == 0)
    runner.allocator.pool.check_invariants()
    await eventually(lambda: reply.kv.lease_id not in leases._leases, timeout_s=2)
    assert (leases.released, leases.expired) == (released + 1, expired)  # not run out
