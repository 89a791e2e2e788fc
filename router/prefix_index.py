"""Which KV blocks each prefill and decode worker caches, followed through their KV event
streams (prefill's `StreamKvEvents`, decode's `StreamDecodeKvEvents`).

For every KV worker the router routes to, a background task subscribes to the worker's
KV event stream: the first message is a snapshot (STORED with every cached hash),
then STORED / REMOVED / CLEARED events follow in order. The set can lag the worker by a few
milliseconds, so it is a routing hint, never a promise: a worker that evicted a block in
the meantime simply computes it (and a skipped encoder item is re-encoded, see
`router.orchestrator`). When a stream breaks, the worker's set is emptied (no hint is
better than a stale one) and the task resubscribes with backoff until the worker is
forgotten.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from common.multimodal.validation import HASH_BYTES
from common.roles import Role
from common.server.peers import PeerClient
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    kv_pb2,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
)

logger = logging.getLogger(__name__)

# Hashes one worker may hold here: far past any real pool's blocks, so that a worker
# announcing without end (a bug) costs the router a bounded ~250 MB, not all its memory.
MAX_HASHES_PER_WORKER = 1 << 20


class PrefixIndex:
    """Cached block hashes per KV worker address (see the module docstring).

    Besides each worker's set, one map from a hash to the workers holding it (a bit per
    worker) serves `cached_prefixes`' lookups for every worker at once."""

    def __init__(self, channels: PeerClient, *, retry_s: float = 0.5) -> None:
        self.channels = channels
        self.retry_s = retry_s
        self._hashes: dict[str, set[bytes]] = {}
        self._holders: dict[bytes, int] = {}  # hash -> bits of the workers caching it
        self._bits: dict[str, int] = {}  # worker address -> its bit
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def track(self, address: str, role: Role = Role.PREFILL) -> None:
        """Follow the `role` worker (prefill or decode) at `address` (idempotent; needs a
        running loop)."""
        if address not in self._tasks:
            self._reset(address)
            follow = self._follow(address, role)
            self._tasks[address] = asyncio.get_running_loop().create_task(follow)

    def forget(self, address: str) -> None:
        """Stop following a worker that went away."""
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
        self._reset(address)
        self._hashes.pop(address, None)
        self._bits.pop(address, None)

    def cached_prefix(self, address: str, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of `block_hashes` the worker is known to cache."""
        return self.cached_prefixes(block_hashes).get(address, 0)

    def cached_prefixes(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """`cached_prefix` of every worker caching the first block (the others have 0), by
        binary search: about `log2(len(block_hashes))` lookups per worker, shared between
        workers where their searches probe the same block.

        Exact because what a worker caches of one prompt's blocks is a prefix of them: a
        worker stores a block only together with every block before it (each hash chains
        its whole prefix), and its pool evicts a sequence's blocks last to first, the
        least recently released first (`common.kv.block_pool`), so no block outlives the
        ones before it. Only a block uncached because its bytes changed leaves a hole; the
        answer may then overstate that worker's prefix, which, as any lag of the events,
        the worker computes (module docstring)."""
        n = len(block_hashes)
        get = self._holders.get
        first = get(block_hashes[0], 0) if n else 0
        out: dict[str, int] = {}
        if not first:
            return out
        probed = {0: first}  # block -> bits of the workers holding it
        for address, bit in self._bits.items():
            if not first & bit:
                continue
            lo, hi = 1, n  # the worker holds block lo - 1; its prefix is in [lo, hi]
            while lo < hi:
                mid = (lo + hi) // 2
                held = probed.get(mid)
                if held is None:
                    held = probed[mid] = get(block_hashes[mid], 0)
                if held & bit:
                    lo = mid + 1
                else:
                    hi = mid
            out[address] = lo
        return out

    def _subscribe(self, address: str, role: Role) -> grpc.aio.UnaryStreamCall[Any, Any]:
        """Open the worker's KV event stream (its responses all carry `events`)."""
        channel = self.channels.get(address)
        if role == Role.DECODE:
            return decode_service_pb2_grpc.DecodeServiceStub(channel).StreamDecodeKvEvents(
                decode_service_pb2.StreamDecodeKvEventsRequest(subscriber="router")
            )
        return prefill_service_pb2_grpc.PrefillServiceStub(channel).StreamKvEvents(
            prefill_service_pb2.StreamKvEventsRequest(subscriber="router")
        )

    async def _follow(self, address: str, role: Role) -> None:
        delay = self.retry_s
        while True:
            call = None
            try:
                call = self._subscribe(address, role)
                first = True
                async for response in call:
                    if first:
                        self._reset(address)
                        first = False
                        delay = self.retry_s
                    self._apply(address, response.events)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("%s streams no KV events; no cache-aware routing to it", address)
                    self._reset(address)
                    return
                logger.debug("KV events of %s: %s; resubscribing", address, exc.code().name)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # `forget` or `close`
                # The channel was closed under the stream (`PeerClient.keep_only`): grpc
                # cancels its calls, and the worker's hashes would stay, never followed.
                logger.debug("KV events of %s: channel closed; resubscribing", address)
            except Exception:  # its hints would stay as they were, never followed again
                logger.warning("KV events of %s failed; resubscribing", address, exc_info=True)
            finally:
                if call is not None:
                    call.cancel()
            self._reset(address)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    def _bit(self, address: str) -> int:
        bit = self._bits.get(address)
        if bit is None:
            used = set(self._bits.values())
            bit = next(1 << k for k in itertools.count() if 1 << k not in used)
            self._bits[address] = bit
        return bit

    def _reset(self, address: str) -> None:
        """Forget every block of the worker at `address` (it stays tracked)."""
        cached = self._hashes.get(address)
        if cached:
            self._drop(self._bit(address), cached)
        self._hashes[address] = set()

    def _drop(self, bit: int, hashes: Iterable[bytes]) -> None:
        holders = self._holders
        for h in hashes:
            left = holders.get(h, 0) & ~bit
            if left:
                holders[h] = left
            else:
                holders.pop(h, None)

    def _apply(self, address: str, events: Sequence[kv_pb2.KvEvent]) -> None:
        cached = self._hashes.setdefault(address, set())
        bit = self._bit(address)
        holders = self._holders
        for event in events:
            if event.kind == kv_pb2.KV_EVENT_KIND_STORED:
                # Only new hashes count (announced again: none), in the event's own time: a
                # copy of `cached` per event made a 36-byte event cost 0.13 s at the bound,
                # and a registered worker held the loop 26 s with 8 KB (s35 routing review).
                stored = (
                    [h for h in event.block_hashes if len(h) == HASH_BYTES]
                    if len(event.block_hashes) <= MAX_HASHES_PER_WORKER
                    else None  # past the bound alone: not even listed
                )
                if stored is None or (
                    len(cached) + len(stored) > MAX_HASHES_PER_WORKER
                    and len(cached) + len(set(stored).difference(cached)) > MAX_HASHES_PER_WORKER
                ):
                    logger.warning(
                        "KV worker %s announced over %d cached blocks; its hints are dropped",
                        address,
                        MAX_HASHES_PER_WORKER,
                    )
                    self._reset(address)
                    return
                cached.update(stored)
                for h in stored:
                    holders[h] = holders.get(h, 0) | bit
            elif event.kind == kv_pb2.KV_EVENT_KIND_REMOVED:
                gone = cached.intersection(event.block_hashes)
                cached.difference_update(gone)
                self._drop(bit, gone)
            elif event.kind == kv_pb2.KV_EVENT_KIND_CLEARED:
                self._drop(bit, cached)
                cached.clear()
            else:  # a kind from a newer worker: what it changed is unknown, so forget all
                logger.warning(
                    "KV worker %s sent an event of unknown kind %d; its hints are dropped",
                    address,
                    event.kind,
                )
                self._reset(address)
                return

    async def close(self) -> None:
        """Stop following every worker."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._hashes.clear()
        self._holders.clear()
        self._bits.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
