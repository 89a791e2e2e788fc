"""Planning a KV import on a decode worker whose pool is full: wait for the decode loop to
free blocks, keeping the handle's lease alive meanwhile (DESIGN §4).

    plan(hashes, n, total, handle) -> ImportPlan (`KvAllocator.plan_import`), once the pool
        has room; RESOURCE_EXHAUSTED (NoFreeBlocksError) at once for a request the whole
        pool cannot hold, or when no block is in use (none will be freed); ABORTED when the
        holder says the lease ended meanwhile (the router prefills again). The caller's
        deadline bounds the wait.

Waiting requests are served in arrival order: once one waits, a later request waits behind
it, and only the first plans again when blocks are freed (a steady flow of small requests
took each freed block before an older large one found enough free at once, until its
deadline). As in vLLM's scheduler, the first waits for the running streams to free what it
lacks, however long they take (each ends by its max_tokens), and the others wait behind it,
even where they would fit now: a later version let them plan once the first had waited
3 s, and a large request behind a steady flow of small ones was never planned again
whenever streams ran longer than that. A request the whole pool cannot hold is refused at
once (`PoolTooSmallError`), never queued. The router's admission is first come first
served too, but not across routers, nor for a tenant placed ahead, nor for direct callers.

While it waits, the lease is renewed at once (the handle may have spent most of it on its
way here), then every third of what the holder says is left. A holder that does not answer
is no reason to stop: the confirmation after the READ says whether the lease held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from common.errors import LEASE_NOT_LIVE
from common.kv.allocator import ImportPlan, KvAllocator, blocks_for
from common.kv.block_pool import NoFreeBlocksError, PoolTooSmallError
from common.models.model_thread import ModelThread
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError
from epd.v1 import kv_pb2

if TYPE_CHECKING:
    from decode_worker.kv_import import DecodeCounters

logger = logging.getLogger(__name__)

MIN_RENEW_S = 0.05  # the shortest wait between two renewals of a waiting request's lease
LOOK_S = 1.0  # how often a waiting request plans again, whatever woke it or not


class BlockWait:
    """`plan` for one decode worker's importer; see the module docstring."""

    def __init__(
        self,
        allocator: KvAllocator,
        model: ModelThread,
        peers: PeerClient,
        counters: DecodeCounters,
        freed: Callable[[], asyncio.Event],
        digests_now: Callable[[list[int]], Sequence[bytes]],
        renew_leases: bool = True,
    ) -> None:
        self.allocator = allocator  # called on `model` only
        self.model = model
        self.peers = peers  # RenewKv to the holders
        self.counters = counters  # block_waits, lease_renewals
        # The event the decode loop sets when it next frees blocks (a new one after each).
        self.freed = freed
        self.digests_now = digests_now  # model thread: block ids -> digests of their bytes
        self.renew_leases = renew_leases  # RenewKv while a request waits for blocks
        # Waiting requests in arrival order, each by the event set when it comes first.
        self._queue: deque[asyncio.Event] = deque()

    async def plan(
        self, hashes: list[bytes] | None, n: int, total: int, handle: kv_pb2.KvHandle
    ) -> ImportPlan:
        """`plan_import`, waiting for blocks to be freed when the pool is full; the caller's
        deadline bounds the wait. RESOURCE_EXHAUSTED (NoFreeBlocksError) when the request
        needs more blocks than the pool has, or none is in use (none will be freed).

        While it waits, the handle's lease is renewed at once (the handle may have spent
        most of it on its way here), then every third of what the holder says is left; a
        lease the holder says is gone ends the wait: ABORTED, prefill again."""
        allocator = self.allocator
        pool = allocator.pool
        need = blocks_for(max(total, n), allocator.block_size)
        if need > pool.num_blocks:
            field = (
                "sampling.max_tokens" if n <= pool.num_blocks * allocator.block_size else "prompt"
            )
            raise PoolTooSmallError(need, pool.num_blocks, field)
        every_s = max(handle.lease_ttl_ms / 3000, MIN_RENEW_S)
        renewal: asyncio.Task[float | None] | None = None
        next_renewal = 0.0
        turn: asyncio.Event | None = None  # set while it waits: its place in the queue
        woken: asyncio.Future[Any] | None = None
        emptied = False  # a plan failed with no block in use
        try:
            while True:
                if turn is None and self._queue:  # others wait: behind them
                    turn = self._queue_up(handle)
                first = turn is None or self._queue[0] is turn
                if first:
                    # Taken before the plan looks at the pool: a free the decode loop makes
                    # after the plan failed sets this one (taken after, it was missed and the
                    # request slept `LOOK_S` beside free blocks).
                    freed = self.freed()
                    try:
                        return await self.model.call(
                            allocator.plan_import,
                            hashes,
                            n,
                            total,
                            self.digests_now,
                            on_orphan=lambda p: self.model.submit(allocator.abort_import, p),
                        )
                    except NoFreeBlocksError:
                        # None in use: none will be freed, unless the decode loop freed the
                        # last ones since the plan failed (on the model thread): plan again.
                        if pool.num_used_blocks == 0:
                            if emptied:
                                raise
                            emptied = True
                            continue
                        emptied = False  # blocks in use: this plan waits for them
                    if turn is None:
                        turn = self._queue_up(handle)
                if renewal is not None and renewal.done():
                    every_s = self._renewed(renewal, handle, every_s)
                    next_renewal, renewal = time.monotonic() + every_s, None
                if self.renew_leases and renewal is None and time.monotonic() >= next_renewal:
                    next_renewal = time.monotonic() + every_s
                    self.counters.lease_renewals += 1
                    renewal = asyncio.ensure_future(
                        self.peers.renew_kv(handle.holder_address, handle.lease_id)
                    )
                # The first waits for freed blocks, the others for their turn; each for the
                # next renewal too, or a look every `LOOK_S` (blocks an import gives back,
                # not the decode loop, wake no one).
                assert turn is not None  # in the queue once a plan failed
                woken = asyncio.ensure_future(freed.wait() if first else turn.wait())
                waits: set[asyncio.Future[Any]] = {woken} if renewal is None else {woken, renewal}
                timeout = LOOK_S
                if self.renew_leases:
                    timeout = min(max(next_renewal - time.monotonic(), MIN_RENEW_S), LOOK_S)
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
        finally:
            for task in (renewal, woken):
                if task is not None:  # a wait for a turn that will not come, else left
                    task.cancel()
            if turn is not None:  # planned, failed or gone: the next in line plans now
                if self._queue[0] is turn and len(self._queue) > 1:
                    self._queue[1].set()
                self._queue.remove(turn)

    def _queue_up(self, handle: kv_pb2.KvHandle) -> asyncio.Event:
        """A place at the end of the queue of waiting requests (counted, logged)."""
        turn = asyncio.Event()
        if not self._queue:
            turn.set()  # first in line
        self._queue.append(turn)
        self.counters.block_waits += 1
        logger.info("a request waits for free KV blocks (lease %s)", handle.lease_id)
        return turn

    @staticmethod
    def _renewed(
        renewal: asyncio.Task[float | None], handle: kv_pb2.KvHandle, every_s: float
    ) -> float:
        """The interval to the next renewal after `renewal`'s answer: a third of what is left;
        `every_s` when the holder could not be reached (the confirmation after the READ tells).
        Raises ABORTED when the holder says the lease is gone."""
        try:
            left = renewal.result()
        except grpc.aio.AioRpcError as exc:
            logger.warning("RenewKv(%s) failed: %s", handle.lease_id, exc.code().name)
            return every_s
        if left is None:
            raise RpcStatusError(
                grpc.StatusCode.ABORTED,
                f"kv: the handle's lease {LEASE_NOT_LIVE} once the request had waited for free "
                "KV blocks; prefill again",
            )
        return max(left / 3, MIN_RENEW_S)
