"""The decode side of a KV import when things go wrong at the worst moment (DESIGN §4): a
caller that goes away while a READ runs, a READ that then cannot be cancelled, a sequence
that fails to start after its caller left, and a cached block whose bytes changed before
its reuse. Real allocator, KV buffer, digests and model thread; the transfer agent is a
stand-in that fails as NIXL can (a READ that times out, cancelled or not)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from common import kv_pull
from common.kv.allocator import KvAllocator
from common.kv.block_pool import NoFreeBlocksError
from common.kv.cache import KvCacheSpec, PagedKvCache
from common.kv.digest import cache_block_digests
from common.kv_pull import pull
from common.models.model_thread import ModelThread
from common.sampling import SamplingParams
from common.server.rpc import RpcStatusError
from common.transfer.types import TransferStats, TransferTimeoutError
from decode_worker.kv_import import DecodeCounters, KvImporter
from epd.v1 import kv_pb2, tensor_pb2

BLOCK_BYTES = 4 << 20


class SlowAgent:
    """A NIXL agent whose READ takes `seconds`, then raises `error` (None: succeeds)."""

    peers = ("holder",)

    def __init__(self, seconds: float, error: BaseException | None) -> None:
        self.seconds, self.error = seconds, error

    def add_peer(self, metadata: bytes) -> str:
        return "holder"

    def read(self, *args: Any, **kwargs: Any) -> TransferStats:
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        return TransferStats(1, 1, 1, 0.0)


def big_blocks_runner(allocator: KvAllocator) -> Any:
    """The parts of an `LmRunner` `pull` reads, with blocks too large to READ inline."""
    kv = types.SimpleNamespace(
        spec=types.SimpleNamespace(block_bytes=BLOCK_BYTES),
        block_address=lambda b: (0x1000_0000 + b * BLOCK_BYTES, BLOCK_BYTES),
    )
    return types.SimpleNamespace(kv=kv, allocator=allocator)


async def cancel_during_read(error: TransferTimeoutError) -> KvAllocator:
    """Start a pull of three blocks whose READ ends in `error`, cancel the caller while it
    runs, wait for the READ to end; the allocator (the caller's `on_orphan` aborts the
    plan, as `KvImporter.admit` does)."""
    allocator = KvAllocator.create(8, 16, b"r" * 32)
    plan = allocator.plan_import(None, 40, 48)
    handle = kv_pb2.KvHandle(
        agent_name="holder",
        agent_metadata=b"m",
        memory_kind=tensor_pb2.MEMORY_KIND_HOST,
        blocks=[
            kv_pb2.KvBlockDescriptor(address=i * BLOCK_BYTES, length=BLOCK_BYTES) for i in range(3)
        ],
    )
    task = asyncio.ensure_future(
        pull(
            SlowAgent(0.3, error),  # type: ignore[arg-type]
            big_blocks_runner(allocator),
            handle,
            plan,
            timeout_s=0.2,
            on_orphan=lambda: allocator.abort_import(plan),
            on_quarantine=lambda error: error.when_released(lambda: allocator.abort_import(plan)),
        )
    )
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.5)  # the READ ends meanwhile
    return allocator


@pytest.mark.asyncio
async def test_orphaned_read_that_could_not_be_cancelled_keeps_its_blocks() -> None:
    allocator = await cancel_during_read(TransferTimeoutError("timed out", cancelled=False))
    # NIXL may still write those blocks: they are never handed out again.
    assert allocator.pool.num_used_blocks == 3
    assert not set(allocator.pool.allocate(3)) & {0, 1, 2}


@pytest.mark.asyncio
async def test_quarantined_blocks_come_back_once_nixl_lets_the_read_go() -> None:
    # They were kept for good: a pool that such READs filled never served again.
    error = TransferTimeoutError("timed out", cancelled=False)
    error.released = concurrent.futures.Future()
    allocator = await cancel_during_read(error)
    assert allocator.pool.num_used_blocks == 3
    error.released.set_result(None)  # `ParkedHandles` released the handle at last
    assert allocator.pool.num_used_blocks == 0


@pytest.mark.asyncio
async def test_orphaned_read_that_was_cancelled_gives_its_blocks_back() -> None:
    allocator = await cancel_during_read(TransferTimeoutError("timed out", cancelled=True))
    assert allocator.pool.num_used_blocks == 0


def small_kv() -> tuple[PagedKvCache, KvAllocator]:
    spec = KvCacheSpec(1, 1, 8, 4, torch.float32, 8)
    return PagedKvCache(spec), KvAllocator.create(8, 4, b"r" * 32)


def test_import_plan_pulls_a_cached_block_whose_bytes_changed() -> None:
    kv, allocator = small_kv()
    hashes = [b"h0" * 16, b"h1" * 16]
    plan = allocator.plan_import(hashes, 8, 9)
    kv.buffer[plan.blocks[0]].fill_(1.0)
    kv.buffer[plan.blocks[1]].fill_(2.0)  # pulled, verified: their digests recorded
    allocator.finish_import(plan, hashes, cache_block_digests(kv, plan.blocks[:2]))
    allocator.release(plan.blocks)
    kv.buffer[plan.blocks[0]].view(-1)[0] = 9.0  # a stray write into a cached block

    def digests_now(ids: list[int]) -> list[bytes]:
        return cache_block_digests(kv, ids)

    again = allocator.plan_import(hashes, 8, 9, digests_now)
    assert again.reused == [1]  # the unchanged block only
    assert again.pull == [0]
    assert allocator.digest_mismatches == 1
    assert allocator.pool.get(hashes[0]) is None  # uncached: never found again
    allocator.abort_import(again)
    allocator.pool.check_invariants()


def never_freed() -> asyncio.Event:
    """The decode loop's `freed` of a worker that never frees a block."""
    return asyncio.Event()


def two_block_handle(kv: PagedKvCache, digest: bytes) -> kv_pb2.KvHandle:
    """A handle of two blocks (both with `digest`) held by "holder" under lease "L"."""
    return kv_pb2.KvHandle(
        agent_name="holder",
        agent_metadata=b"m",
        memory_kind=tensor_pb2.MEMORY_KIND_HOST,
        lease_id="L",
        holder_address="h",
        lease_ttl_ms=10_000,
        blocks=[kv_pb2.KvBlockDescriptor(address=0, length=kv.spec.block_bytes)] * 2,
        block_digests=[digest, digest],
    )


def importer_of(runner: Any, agent: Any, peers: Any, *, renew: bool = True) -> KvImporter:
    """A `KvImporter` over these stand-ins, on a model thread of its own (`model`), whose
    decode loop never frees a block."""
    return KvImporter(
        runner, ModelThread(), agent, peers, DecodeCounters(), never_freed, renew_leases=renew
    )


@pytest.mark.asyncio
async def test_sequence_that_fails_to_start_after_its_caller_left_frees_its_blocks() -> None:
    kv, allocator = small_kv()

    def resume(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.3)
        raise RuntimeError("the forward failed")

    runner = types.SimpleNamespace(kv=kv, allocator=allocator, resume=resume)

    class Peers:
        def release_kv(self, *args: Any) -> None:
            pass

        async def confirm_release_kv(self, *args: Any) -> bool:
            return True

    handle = two_block_handle(kv, cache_block_digests(kv, [0])[0])
    importer = importer_of(runner, SlowAgent(0.0, None), Peers())
    model = importer.model
    task = asyncio.ensure_future(
        importer.admit(handle, [1] * 6, None, [1], 0, SamplingParams(max_tokens=4), 1.0)
    )
    await asyncio.sleep(0.1)  # the sequence is being made on the model thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.5)
    assert allocator.pool.num_used_blocks == 0
    allocator.pool.check_invariants()
    model.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("cancelled", [True, False])
async def test_a_read_that_timed_out_is_aborted_for_a_prefill_again(cancelled: bool) -> None:
    # A frozen or overloaded holder is no reason to fail the request: ABORTED sends it to
    # prefill again (it reached the client as DEADLINE_EXCEEDED). Blocks of a READ NIXL
    # could not cancel are counted quarantined until NIXL lets it go, then come back.
    kv, allocator = small_kv()
    runner = types.SimpleNamespace(kv=kv, allocator=allocator)
    released = []

    class Peers:
        def release_kv(self, *args: Any) -> None:
            released.append(args)

    error = TransferTimeoutError("READ timed out", cancelled=cancelled)
    error.released = None if cancelled else concurrent.futures.Future()
    handle = two_block_handle(kv, b"d" * 32)
    importer = importer_of(runner, SlowAgent(0.0, error), Peers())
    model = importer.model
    try:
        with pytest.raises(RpcStatusError) as refused:
            await importer.admit(handle, [1] * 6, None, [1], 0, SamplingParams(max_tokens=4), 1.0)
        assert refused.value.code == grpc.StatusCode.ABORTED
        assert "prefill again" in refused.value.details and len(released) == 1
        assert importer.counters.pull_seconds > 0  # the time it took counts, as READ time
        if not cancelled:
            assert sum(importer.quarantined.values()) == allocator.pool.num_used_blocks > 0
            assert error.released is not None
            error.released.set_result(None)
            for _ in range(100):
                if not importer.quarantined and allocator.pool.num_used_blocks == 0:
                    break
                await asyncio.sleep(0.01)
        assert not importer.quarantined and allocator.pool.num_used_blocks == 0
    finally:
        model.close()


async def timed_pull(
    agent: Any, allocator: KvAllocator, timeout_s: float
) -> tuple[float, BaseException | None]:
    """One pull of one block through `agent`: seconds it took, and what it raised."""
    plan = allocator.plan_import(None, 4, 8)
    handle = kv_pb2.KvHandle(
        agent_name="holder",
        agent_metadata=b"m",
        memory_kind=tensor_pb2.MEMORY_KIND_HOST,
        blocks=[kv_pb2.KvBlockDescriptor(address=0, length=BLOCK_BYTES)],
        block_digests=[b"d"],
    )
    start = time.monotonic()
    try:
        await pull(
            agent,
            big_blocks_runner(allocator),
            handle,
            plan,
            timeout_s=timeout_s,
            on_orphan=lambda: None,
            on_quarantine=lambda error: None,
        )
    except Exception as exc:
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


@pytest.fixture
def fake_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_pull, "cache_block_digests", lambda kv, ids: [b"d"] * len(ids))


@pytest.mark.asyncio
async def test_a_stalled_read_leaves_the_loop_and_healthy_pulls_free(fake_digests: None) -> None:
    allocator = KvAllocator.create(64, 4, b"r" * 32)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    # More stalled READs than the event loop's default executor has threads on a small
    # machine (min(32, cores + 4)): a healthy holder's pull does not queue behind them.
    stalled = [
        asyncio.ensure_future(timed_pull(SlowAgent(0.5, None), allocator, 5.0)) for _ in range(8)
    ]
    await asyncio.sleep(0.05)
    healthy, error = await timed_pull(SlowAgent(0.0, None), allocator, 5.0)
    assert error is None and healthy < 0.3
    await asyncio.gather(*stalled)
    ticker.cancel()
    assert ticks >= 20  # the loop ran on through the 0.5 s READs


@pytest.mark.asyncio
async def test_time_spent_waiting_for_a_thread_counts_against_the_timeout(
    fake_digests: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = ThreadPoolExecutor(1)
    monkeypatch.setattr(kv_pull, "_pulls", one)
    allocator = KvAllocator.create(64, 4, b"r" * 32)
    agent = SlowAgent(0.4, None)
    first = asyncio.ensure_future(timed_pull(agent, allocator, 5.0))
    await asyncio.sleep(0.05)
    waited, error = await timed_pull(agent, allocator, 0.2)
    # Its READ never started: timed out having waited for the only thread, cancelled
    # (nothing can still write its blocks).
    assert isinstance(error, TransferTimeoutError) and error.cancelled
    assert waited < 0.35  # its 0.2 s, not the other READ's 0.4 s it queued behind
    assert (await first)[1] is None
    one.shutdown()


def test_a_plan_that_waits_for_blocks_counts_its_lookups_once() -> None:
    # A request waiting for free blocks plans again on every wake-up: the prefix-cache
    # lookups (`vllm:prefix_cache_queries` / `_hits`) count the plan that got its blocks.
    allocator = KvAllocator.create(6, 4, b"r" * 32)
    hashes = [bytes([i]) * 32 for i in range(3)]
    first = allocator.plan_import(hashes, 12, 12)
    allocator.finish_import(first, hashes)
    allocator.abort_import(first)  # its blocks stay cached, unreferenced
    hog = allocator.pool.allocate(3)  # 3 of 6 left: the 3 cached
    before = (allocator.pool.lookups, allocator.pool.hits)
    for _ in range(3):  # the three hits, and 2 blocks more than are free
        with pytest.raises(NoFreeBlocksError):
            allocator.plan_import(hashes, 12, 20)
    assert (allocator.pool.lookups, allocator.pool.hits) == before
    allocator.pool.release(hog)
    allocator.plan_import(hashes, 12, 20)
    assert (allocator.pool.lookups, allocator.pool.hits) == (before[0] + 3, before[1] + 3)


def test_a_lease_the_holder_said_was_gone_is_told_from_one_it_did_not_confirm() -> None:
    # The router suspects the holder unless it said the lease was gone: a frozen holder
    # (no answer) must not read as one that let its lease go (chaos review, s37).
    from common.errors import LEASE_NOT_LIVE
    from decode_worker.kv_import import lease_lost
    from epd.v1 import kv_pb2

    handle = kv_pb2.KvHandle(holder_address="h:1", lease_id="l")
    assert LEASE_NOT_LIVE in lease_lost(handle, False).details
    assert LEASE_NOT_LIVE not in lease_lost(handle, None).details


@pytest.mark.asyncio
@pytest.mark.parametrize("said", [True, False, None])
async def test_blocks_failing_their_digests_are_corruption_only_under_a_live_lease(
    said: bool | None,
) -> None:
    # A lease the holder says was gone lets its blocks change: a lost lease, not corruption,
    # and not held against the holder; a holder that does not answer is (chaos, s37).
    from common.errors import LEASE_NOT_LIVE

    kv, allocator = small_kv()
    runner = types.SimpleNamespace(kv=kv, allocator=allocator)

    class Peers:
        def release_kv(self, *args: Any) -> None:
            pass

        async def confirm_release_kv(self, *args: Any) -> bool | None:
            return said

    handle = two_block_handle(kv, b"d" * 32)  # not what the READ brings
    importer = importer_of(runner, SlowAgent(0.0, None), Peers())
    try:
        with pytest.raises(RpcStatusError) as refused:
            await importer.admit(handle, [1] * 6, None, [1], 0, SamplingParams(max_tokens=4), 1.0)
        assert refused.value.code == grpc.StatusCode.ABORTED
        gone = said is False
        assert (LEASE_NOT_LIVE in refused.value.details) == gone
        assert (importer.counters.digest_mismatches == 0) == gone
        assert importer.counters.leases_lost == int(gone)
        assert allocator.pool.num_used_blocks == 0 and not allocator.cached_hashes()
    finally:
        importer.model.close()
