"""The decode worker's NIXL READ of a handed-off prompt's KV blocks (`common.handoff` checks the
handle first).

`pull` READs, in one NIXL transfer (adjacent blocks merged into one descriptor on both
sides), the prompt blocks an `ImportPlan` lacks into the plan's own blocks, then digests
them, on a worker thread: a READ waits on its holder (up to the pull timeout when the
holder stalls), which the event loop must not (every other stream, the decode loop and the
health checks run on it). The threads are this module's own (`PULL_THREADS`), not the
event loop's default executor (a handful of threads on a small machine, shared with other
work, that a few stalled holders would fill), and a READ that waited for one has that
much less of its timeout. The plan's blocks stay owned by the caller throughout; if the
awaiting task is cancelled while the READ runs, `on_orphan` is called once the READ has
finished (NIXL may write the blocks until then), so the caller can give the blocks back
only when it is safe.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from common.cpu import torch_thread
from common.errors import NO_READ_STARTED
from common.kv.allocator import ImportPlan
from common.kv.digest import cache_block_digests
from common.models.runner import LmRunner
from common.server.rpc import RpcStatusError
from common.transfer.agent import TransferAgent
from common.transfer.types import (
    TransferError,
    TransferRefusedError,
    TransferStats,
    TransferTimeoutError,
)
from common.wire.transfer import KIND_TO_MEMORY
from epd.v1 import kv_pb2

logger = logging.getLogger(__name__)

PULL_THREADS = 32  # READs in flight at once, per process (each mostly waits on its holder)
_pulls = ThreadPoolExecutor(
    PULL_THREADS, thread_name_prefix="epd-kv-pull", initializer=torch_thread
)


@dataclass(frozen=True, slots=True)
class Pulled:
    """What `pull` did: the READ's figures, and which pulled blocks failed their digest."""

    stats: TransferStats | None  # None: nothing was missing, nothing READ
    mismatched: list[int]  # indices into the prompt's blocks whose bytes differ from the handle


def _invalid(field: str, message: str) -> RpcStatusError:
    return RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


async def pull(
    agent: TransferAgent,
    runner: LmRunner,
    handle: kv_pb2.KvHandle,
    plan: ImportPlan,
    *,
    timeout_s: float,
    on_orphan: Callable[[], object],
    on_quarantine: Callable[[TransferTimeoutError], object],
) -> Pulled:
    """READ the plan's missing prompt blocks from the holder and check their digests, within
    `timeout_s` (the wait for one of the pull threads included).

    Raises `RpcStatusError`: INVALID_ARGUMENT when the metadata is refused or names another
    agent, FAILED_PRECONDITION when the holder refuses the READ (descriptors outside its
    registered memory), ABORTED when the holder (or its agent) cannot be reached or fails
    the READ (its KV is unusable, like a lost lease: the router prefills again); and
    `TransferTimeoutError` as is when the READ (or the wait for a thread) timed out, for
    the caller's quarantine decision. When the caller went away (cancelled), the blocks go
    back once the READ is over (`on_orphan()`), or, after a READ that timed out (it may
    still write them), `on_quarantine(error)` keeps them until `error.when_released`.
    """
    if not plan.pull:
        return Pulled(None, [])
    try:
        if handle.agent_name in agent.peers:
            peer = agent.add_peer(handle.agent_metadata)  # known: a cheap comparison
        else:
            try:
                peer = await asyncio.to_thread(agent.add_peer, handle.agent_metadata)
            except asyncio.CancelledError:
                on_orphan()  # no READ was started: the blocks can go back now
                raise
    except (TransferRefusedError, ValueError) as exc:  # the handle's metadata is bad
        raise _invalid("kv.agent_metadata", f"cannot be loaded: {exc}") from None
    except TransferError as exc:  # its agent cannot be reached (the holder died): as a READ
        raise RpcStatusError(
            grpc.StatusCode.ABORTED,
            f"kv.agent_metadata: the holder's NIXL agent cannot be reached: {exc}; prefill again",
        ) from None
    if peer != handle.agent_name:
        raise _invalid("kv.agent_name", f"{handle.agent_name!r}, but its metadata is {peer!r}")
    remote = [(handle.blocks[i].address, handle.blocks[i].length) for i in plan.pull]
    local_ids = [plan.blocks[i] for i in plan.pull]
    local = [runner.kv.block_address(b) for b in local_ids]
    read = functools.partial(
        _read_and_digest,
        agent,
        runner,
        peer,
        remote,
        local,
        local_ids,
        deadline=time.monotonic() + timeout_s,
        remote_memory=KIND_TO_MEMORY[handle.memory_kind],
        remote_device_id=handle.blocks[0].device_id,
        peer_metadata=handle.agent_metadata,
    )
    work = _pulls.submit(read)
    future = asyncio.wrap_future(work)
    try:
        try:
            async with asyncio.timeout(timeout_s):
                stats, digests = await asyncio.shield(future)
        except TimeoutError:
            if work.cancel():  # still waiting for a thread: no READ was started
                raise TransferTimeoutError(
                    f"the KV pull timed out waiting for a pull thread: {NO_READ_STARTED}", True
                ) from None
            stats, digests = await asyncio.shield(future)  # its READ has its own deadline
    except asyncio.CancelledError:
        settled = functools.partial(_settled, on_orphan=on_orphan, on_quarantine=on_quarantine)
        future.add_done_callback(settled)
        raise
    mismatched = [
        i
        for i, got in zip(plan.pull, digests, strict=True)
        if not hmac.compare_digest(got, handle.block_digests[i])
    ]
    return Pulled(stats, mismatched)


def _settled(
    read: asyncio.Future[object],
    *,
    on_orphan: Callable[[], object],
    on_quarantine: Callable[[TransferTimeoutError], object],
) -> None:
    """A READ whose caller went away has ended: its blocks go back (`on_orphan`), unless it
    timed out: it may still write them, so they are kept until it has ended and been let
    go (`on_quarantine`), as the caller does when it is still there."""
    failure = None if read.cancelled() else read.exception()  # retrieved, either way
    if isinstance(failure, TransferTimeoutError) and not failure.cancelled:
        on_quarantine(failure)
        return
    on_orphan()


def _read_and_digest(
    agent: TransferAgent,
    runner: LmRunner,
    peer: str,
    remote: list[tuple[int, int]],
    local: list[tuple[int, int]],
    local_ids: list[int],
    *,
    deadline: float,
    remote_memory: str,
    remote_device_id: int,
    peer_metadata: bytes,
) -> tuple[TransferStats, list[bytes]]:
    """One READ, then the digests of the blocks it wrote (same thread: no hop between),
    given what is left until `deadline` (`time.monotonic`) as its timeout."""
    left = deadline - time.monotonic()
    if left <= 0:  # spent waiting for a thread: no READ was started
        raise TransferTimeoutError(f"the KV pull timed out: {NO_READ_STARTED}", True)
    try:
        stats = agent.read(
            peer,
            remote,
            local,
            timeout_s=left,
            remote_memory=remote_memory,
            remote_device_id=remote_device_id,
            peer_metadata=peer_metadata,
        )
    except TransferTimeoutError:
        raise
    except TransferRefusedError as exc:
        raise RpcStatusError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"kv.blocks: the holder's NIXL agent refused the READ: {exc}",
        ) from None
    except TransferError as exc:
        # The holder is gone or failed the READ: its KV is unusable, like a lost lease, so
        # the caller prefills again (ABORTED) rather than trying this handle elsewhere.
        raise RpcStatusError(
            grpc.StatusCode.ABORTED,
            f"kv.blocks: the READ from the holder failed: {exc}; prefill again",
        ) from None
    return stats, cache_block_digests(runner.kv, local_ids)
