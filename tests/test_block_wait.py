"""The decode worker's wait for free KV blocks (`decode_worker.block_wait`), over a fake
allocator whose free blocks the test sets: waiting requests are planned in arrival order,
and a request the whole pool cannot hold is refused at once, naming the setting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from common.kv.allocator import blocks_for
from common.kv.block_pool import KV_POOL_FULL, NoFreeBlocksError, PoolTooSmallError
from common.server.rpc import status_for
from decode_worker.block_wait import BlockWait
from epd.v1 import kv_pb2

BLOCK = 8


class Allocator:
    """`plan_import` takes `blocks_for(total)` blocks while that many are free."""

    block_size = BLOCK

    def __init__(self, num_blocks: int, free: int) -> None:
        self.pool = self  # num_blocks, num_used_blocks
        self.num_blocks = num_blocks
        self.free = free

    @property
    def num_used_blocks(self) -> int:
        return max(self.num_blocks - self.free, 0)

    def plan_import(self, hashes: Any, n: int, total: int, digests_now: Any) -> int:
        need = blocks_for(total, BLOCK)
        if need > self.free:
            raise NoFreeBlocksError(need, self.free)
        self.free -= need
        return need

    def abort_import(self, plan: Any) -> None:
        raise AssertionError("nothing is orphaned here")


class Model:
    """The model thread, run inline."""

    async def call(self, fn: Callable[..., Any], *args: Any, on_orphan: Any = None) -> Any:
        return fn(*args)


class Frees:
    """The decode loop's signal of freed blocks, as `DecodeBatcher` keeps it: `set` sets the
    current event and makes a new one."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def current(self) -> asyncio.Event:
        return self.event

    def set(self) -> None:
        event, self.event = self.event, asyncio.Event()
        event.set()


def waiting(allocator: Allocator, freed: Frees, model: Model | None = None) -> BlockWait:
    counters = SimpleNamespace(block_waits=0, lease_renewals=0)
    return BlockWait(
        allocator,  # type: ignore[arg-type]
        model or Model(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        counters,  # type: ignore[arg-type]
        freed.current,
        lambda ids: [],
        renew_leases=False,
    )


HANDLE = kv_pb2.KvHandle(lease_id="l", lease_ttl_ms=60_000)


async def test_a_large_request_waiting_first_is_planned_before_later_small_ones() -> None:
    # Small requests that came later took each freed block before an older one needing 16
    # of the 20 ever found enough free at once: it waited until its deadline.
    allocator, freed = Allocator(num_blocks=20, free=2), Frees()
    wait = waiting(allocator, freed)
    order: list[str] = []

    async def request(name: str, blocks: int) -> None:
        await wait.plan(None, 4, blocks * BLOCK, HANDLE)
        order.append(name)

    big = asyncio.create_task(request("big", 16))
    await asyncio.sleep(0.01)
    small = []
    for i in range(6):  # the decode loop frees 3 blocks, and a small request arrives
        allocator.free += 3
        freed.set()
        small.append(asyncio.create_task(request(f"small{i}", 3)))
        await asyncio.sleep(0.01)
    allocator.free += 18  # the rest finish
    freed.set()
    await asyncio.wait_for(asyncio.gather(big, *small), 10)
    assert order == ["big", *(f"small{i}" for i in range(6))]
    assert wait.counters.block_waits == 7 and not wait._queue


async def test_a_waiter_that_goes_away_lets_the_next_one_plan() -> None:
    allocator, freed = Allocator(num_blocks=20, free=0), Frees()
    wait = waiting(allocator, freed)
    first = asyncio.create_task(wait.plan(None, 4, 16 * BLOCK, HANDLE))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(wait.plan(None, 4, 2 * BLOCK, HANDLE))
    await asyncio.sleep(0.01)
    allocator.free = 2
    first.cancel()  # its client went away: the one behind it plans now, not at the next free
    assert await asyncio.wait_for(second, 0.5) == 2
    assert first.cancelled() and not wait._queue


@pytest.mark.parametrize(("prompt", "field"), [(4, "sampling.max_tokens"), (200, "prompt")])
async def test_a_request_the_whole_pool_cannot_hold_is_refused_at_once(
    prompt: int, field: str
) -> None:
    # It read "KV pool full: wanted 9 KV blocks, only 6 free", as a pool full for now.
    wait = waiting(Allocator(num_blocks=6, free=6), Frees())
    with pytest.raises(PoolTooSmallError) as refused:
        await wait.plan(None, prompt, 9 * BLOCK if prompt < 9 * BLOCK else prompt, HANDLE)
    code, details = status_for(refused.value)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # as before; not "full" for now, which
    assert not details.startswith(KV_POOL_FULL)  # the router passes on as worth a retry
    assert "whole pool (6, its num_blocks setting)" in details and field in details


async def test_a_waiter_that_goes_away_leaves_no_task_behind() -> None:
    # Its wait for a turn that would never come was left pending, one task per request.
    allocator, freed = Allocator(num_blocks=20, free=0), Frees()
    wait = waiting(allocator, freed)
    before = len(asyncio.all_tasks())
    head = asyncio.create_task(wait.plan(None, 4, 16 * BLOCK, HANDLE))
    queued = [asyncio.create_task(wait.plan(None, 4, BLOCK, HANDLE)) for _ in range(20)]
    await asyncio.sleep(0.05)
    for task in (head, *queued):
        task.cancel()
    await asyncio.gather(head, *queued, return_exceptions=True)
    await asyncio.sleep(0.01)
    assert len(asyncio.all_tasks()) == before and not wait._queue


async def test_blocks_freed_just_after_a_failed_plan_wake_the_waiting_request() -> None:
    # The decode step queued on the model thread right behind the failing plan freed blocks,
    # and the loop said so before the request began to wait: it took the signal only then,
    # missed it and slept `LOOK_S` (1 s) beside the free blocks (variance review).
    allocator, freed = Allocator(num_blocks=8, free=1), Frees()

    class StepBehindThePlan(Model):
        stepped = False

        async def call(self, fn: Callable[..., Any], *args: Any, on_orphan: Any = None) -> Any:
            try:
                return fn(*args)
            finally:
                if not self.stepped:  # the decode step after the first plan frees 3 blocks
                    self.stepped = True
                    allocator.free += 3
                    freed.set()

    wait = waiting(allocator, freed, StepBehindThePlan())
    assert await asyncio.wait_for(wait.plan(None, 4, 3 * BLOCK, HANDLE), 0.5) == 3
    assert wait.counters.block_waits == 1 and not wait._queue


async def test_blocks_freed_between_a_failed_plan_and_its_check_are_planned_again() -> None:
    # The plan fails on the model thread; the decode loop frees the last stream's blocks
    # before the failure reaches the event loop. "None in use, none will be freed" was
    # decided there and refused a request the empty pool holds (multi-router review).
    class Racing(Model):
        def __init__(self, allocator: Allocator) -> None:
            self.allocator = allocator

        async def call(self, fn: Callable[..., Any], *args: Any, on_orphan: Any = None) -> Any:
            try:
                return fn(*args)
            except NoFreeBlocksError:
                self.allocator.free = self.allocator.num_blocks  # the stream ended meanwhile
                raise

    allocator = Allocator(num_blocks=48, free=25)
    wait = waiting(allocator, Frees(), Racing(allocator))
    async with asyncio.timeout(5):
        assert await wait.plan(None, 200, 26 * BLOCK, HANDLE) == 26
    # A pool that holds nothing the decode loop frees and still cannot plan is refused, as
    # before (planned a second time, not waited on).

    class Stuck(Allocator):
        @property
        def num_used_blocks(self) -> int:
            return 0

    stuck = Stuck(num_blocks=48, free=20)
    with pytest.raises(NoFreeBlocksError):
        async with asyncio.timeout(5):
            await waiting(stuck, Frees()).plan(None, 200, 26 * BLOCK, HANDLE)
