"""Taking a handed-off prompt's KV onto this decode worker (DESIGN §4), one request at a time.

    admit(handle, ...)  -> Imported: blocks taken (`KvAllocator.plan_import`; while the pool
                           is full, wait for blocks to be freed and keep the lease alive with
                           `RenewKv`), the missing ones READ by NIXL (`common.kv_pull.pull`)
                           and their bytes checked against the handle's `block_digests`, the
                           holder asked to confirm the lease (`ReleaseKv`, in the background),
                           and the sequence made (it owns the plan's blocks)
    confirmed(imported) -> the holder's answer: True, the lease was live throughout the READ,
                           and the pulled full blocks enter this worker's prefix cache; False,
                           it was not, None, no answer (the caller drops the sequence and
                           fails with ABORTED, saying which)
    discard(imported)   -> give up an import not confirmed (its blocks are never cached)

Why the confirmation runs in the background: it is a round trip to a prefill worker busy with
its own forwards, measured at about 20 ms a request under the served benchmark's load, the
largest part of the handoff. The sequence joins the decode batch meanwhile, so its first
steps overlap that wait; but nothing computed from the pulled bytes leaves the worker or
enters its cache before the holder has confirmed: the stream's first chunk waits for
`confirmed`, and a lease that was gone drops the sequence, its blocks go back uncached, and
the call fails with ABORTED (the router prefills again; the client sees no error).

A block whose bytes fail their digest fails `admit` with ABORTED (after the holder has been
told which blocks, so it can recheck them); nothing pulled is used or cached. Where the holder
says the lease was gone (run out, or released by a decode worker that died before its first
chunk, its handle sent on), that is the ABORTED of a lease lost, not a digest failure: the
router does not suspect a holder for it. A block this
worker caches is reused only while its bytes still have the digest recorded when it was
pulled; one that changed is uncached and pulled again (`KvAllocator.plan_import`).

Leases: once `admit` is called it owns releasing the handle's lease exactly once (the
confirming `ReleaseKv`, or a background one on every other path), whatever happens.

Blocks: the plan's blocks are owned by `admit` until the sequence is made, then by the
sequence. The pulled blocks carry one more reference (`Imported.hold`) until the import is
settled (`confirmed` or `discard`), so they cannot be freed, and their ids handed out again,
before their digests are recorded and they are cached, even when the sequence ends first.
On a failure or cancellation in `admit` every block taken goes back to the pool (after the
READ has finished, if one is in flight), except after a READ that timed out: it may still
write those blocks (over TCP a frozen holder's bytes land once it gets going), so they are
quarantined (`quarantined`, the `epd:kv_blocks_quarantined` gauge) until the READ has ended
and been let go (`common.transfer.parked`).
A READ that timed out is ABORTED (the router prefills again), not the request's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import grpc

from common.errors import LEASE_NOT_LIVE, NO_READ_STARTED
from common.kv.allocator import ImportPlan
from common.kv.digest import cache_block_digests
from common.kv_pull import pull
from common.models.model_thread import ModelThread
from common.models.runner import LmRunner
from common.models.sequence import LmSequence
from common.sampling import SamplingParams
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError
from common.transfer.agent import TransferAgent
from common.transfer.types import TransferStats, TransferTimeoutError
from decode_worker.block_wait import BlockWait
from epd.v1 import kv_pb2

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeCounters:
    """What the decode worker did since start (tests, heartbeats, logs)."""

    requests: int = 0  # Decode streams admitted (past validation)
    blocks_pulled: int = 0  # prompt blocks READ from prefill workers and used (lease confirmed)
    bytes_pulled: int = 0  # bytes READ from prefill workers: every READ, used or not
    blocks_reused: int = 0  # full prompt blocks found in this worker's prefix cache
    hash_mismatches: int = 0  # handles refused because their hashes differ
    digest_mismatches: int = 0  # pulled blocks whose bytes failed their digest (re-prefilled)
    leases_lost: int = 0  # pulls discarded because the lease was not live throughout
    lease_renewals: int = 0  # RenewKv calls made while waiting for free blocks
    block_waits: int = 0  # requests that waited for free blocks before their pull
    resumed: int = 0  # streams resumed from another decode worker's tokens (resume_tokens)
    tokens_recomputed: int = 0  # KV of resumed tokens computed here
    pull_seconds: float = 0.0  # wall time spent in READs, timed-out ones included


@dataclass(slots=True)
class Imported:
    """A prompt whose KV is on this worker, its sequence made, its lease being confirmed."""

    seq: LmSequence  # owns the plan's blocks (the caller hands it to the decode loop)
    plan: ImportPlan  # which blocks were reused, which pulled
    hashes: list[bytes] | None  # the prompt's full-block hashes (None: nothing is cached)
    digests: list[bytes]  # the handle's block digests (the pulled ones verified)
    hold: list[int]  # one more reference on each pulled block, until settled
    stats: TransferStats | None  # the READ's figures; None: nothing was missing
    # The confirming ReleaseKv (True: the lease was live); None: nothing READ, released.
    confirmation: asyncio.Future[bool | None] | None
    settled: bool = False  # `confirmed` cached the pulled blocks, or `discard` gave them up


def lease_lost(handle: kv_pb2.KvHandle, said: bool | None) -> RpcStatusError:
    """ABORTED: the holder did not confirm the lease (`said` False: it said the lease was
    gone; None: it did not answer); the router prefills again."""
    why = (
        f"{LEASE_NOT_LIVE} until the READ was confirmed"
        if said is False
        else "could not be confirmed (the holder did not answer)"
    )
    return RpcStatusError(
        grpc.StatusCode.ABORTED,
        f"kv.lease_id: the lease on {handle.holder_address} {why}; nothing pulled is used, "
        "prefill again",
    )


class KvImporter:
    """`admit` / `confirmed` / `discard` for one decode worker; see the module docstring."""

    def __init__(
        self,
        runner: LmRunner,
        model: ModelThread,
        agent: TransferAgent,
        peers: PeerClient,
        counters: DecodeCounters,
        freed: Callable[[], asyncio.Event],
        *,
        renew_leases: bool = True,
    ) -> None:
        self.runner = runner
        self.model = model  # every allocator call runs on it
        self.agent = agent  # READs into the runner's registered KV buffer
        self.peers = peers  # ReleaseKv / RenewKv to the holders
        self.counters = counters
        # Plans the import, waiting for free blocks (renewing the lease) when the pool is full.
        self.blocks = BlockWait(
            runner.allocator, model, peers, counters, freed, self._digests_now, renew_leases
        )
        # id(plan) -> blocks kept from the pool while NIXL may still write them
        self.quarantined: dict[int, int] = {}

    def _quarantine(self, plan: ImportPlan, error: TransferTimeoutError) -> None:
        """Keep the plan's blocks from the pool while NIXL may still write them (a READ that
        timed out), until the READ has ended and been let go (event loop)."""
        logger.error(
            "a KV READ timed out and may still write its %d blocks: quarantined until it ends "
            "(its holder answers or disconnects)",
            len(plan.blocks),
        )
        self.quarantined[id(plan)] = len(plan.blocks)
        loop = asyncio.get_running_loop()
        error.when_released(lambda: loop.call_soon_threadsafe(self._unquarantine, plan))

    def _unquarantine(self, plan: ImportPlan) -> None:
        """The READ ended and was let go: its blocks go back to the pool (event loop), but
        once the model thread has stopped (the worker is closing)."""
        self.quarantined.pop(id(plan), None)
        with contextlib.suppress(RuntimeError):  # "cannot schedule new futures after shutdown"
            self.model.submit(self.runner.allocator.abort_import, plan)

    async def admit(
        self,
        handle: kv_pb2.KvHandle,
        tokens: list[int],
        hashes: list[bytes] | None,
        generated: list[int],
        mrope_delta: int,
        sampling: SamplingParams,
        pull_timeout_s: float,
    ) -> Imported:
        """Take blocks, pull and verify the missing ones, ask the holder to confirm the lease
        (in the background), and make the sequence (computing the KV of resumed tokens, the
        `generated` after the first). Raises ABORTED when a pulled block fails its digest."""
        allocator = self.runner.allocator
        total = len(tokens) + sampling.max_tokens - 1

        def release() -> None:
            self.peers.release_kv(handle.holder_address, handle.lease_id)

        try:
            plan = await self.blocks.plan(hashes, len(tokens), total, handle)
        except BaseException:
            release()
            raise
        started = time.monotonic()
        try:
            pulled = await pull(
                self.agent,
                self.runner,
                handle,
                plan,
                timeout_s=pull_timeout_s,
                on_orphan=lambda: self.model.submit(allocator.abort_import, plan),
                on_quarantine=lambda exc: self._quarantine(plan, exc),
            )
        except asyncio.CancelledError:
            release()
            raise  # on_orphan gives the blocks back once the READ is over
        except TransferTimeoutError as exc:
            if NO_READ_STARTED not in str(exc):  # a READ's time, not a wait for a thread
                self.counters.pull_seconds += time.monotonic() - started
            release()
            if exc.cancelled:
                await self.model.call(allocator.abort_import, plan)
            else:
                self._quarantine(plan, exc)
            # The holder did not answer in time (frozen, or overloaded): not the request's
            # own deadline, which the router keeps. Prefill again elsewhere.
            raise RpcStatusError(
                grpc.StatusCode.ABORTED,
                f"kv: the READ from {handle.holder_address} timed out ({exc}); prefill again",
            ) from None
        except BaseException:
            release()
            await self.model.call(allocator.abort_import, plan)
            raise
        if pulled.stats is not None:  # the network's view: every READ, whatever comes of it
            self.counters.bytes_pulled += pulled.stats.nbytes
            self.counters.pull_seconds += pulled.stats.seconds
        if pulled.mismatched:
            await self._refuse(handle, plan, pulled.mismatched)
        confirmation: asyncio.Future[bool | None] | None = None
        if pulled.stats is None:
            release()  # nothing READ: no byte read under the lease is used
        else:
            confirmation = asyncio.ensure_future(
                self.peers.confirm_release_kv(handle.holder_address, handle.lease_id)
            )
            # Retrieved even when no stream waits for it any more (it went away).
            confirmation.add_done_callback(lambda f: f.cancelled() or f.exception())
        hold = [plan.blocks[i] for i in plan.pull]
        try:
            seq = await self.model.call(
                self._start,
                plan,
                hold,
                tokens,
                mrope_delta,
                sampling,
                generated,
                on_orphan=lambda s: self.model.submit(self._abandon, s, hold),
            )
        except asyncio.CancelledError:
            # on_orphan gives the blocks back once the sequence is made; `_start` does if
            # it fails.
            raise
        digests = list(handle.block_digests)
        return Imported(seq, plan, hashes, digests, hold, pulled.stats, confirmation)

    async def confirmed(self, imported: Imported) -> bool | None:
        """Wait for the holder's answer. True: the lease was live throughout the READ; the
        pulled blocks' digests are recorded and the full ones cached (on the model thread,
        before any call queued after this one). False: the holder said it was not; None: it
        did not answer (either counted); the caller drops the sequence and calls `discard`."""
        live: bool | None = True
        if imported.confirmation is not None:
            live = await asyncio.shield(imported.confirmation)
        c = self.counters
        if not live:
            c.leases_lost += 1
            return live
        imported.settled = True
        self.model.submit(self._finish, imported)
        c.blocks_pulled += len(imported.plan.pull)
        c.blocks_reused += len(imported.plan.reused)
        return True

    def discard(self, imported: Imported) -> concurrent.futures.Future[None] | None:
        """Give up an unsettled import: the hold on its pulled blocks is dropped (on the model
        thread; the returned future is done then) and they are never cached. None when the
        import was settled already. The lease is released all the same (the confirmation
        still runs)."""
        if imported.settled:
            return None
        imported.settled = True
        return self.model.submit(self.runner.allocator.release, imported.hold)

    # ---------------------------------------------------------------- model thread

    def _digests_now(self, block_ids: list[int]) -> list[bytes]:
        """Model thread: the digests of these blocks' bytes now, so that a cached block is
        reused only while its bytes are the ones pulled and verified (DESIGN §4)."""
        return cache_block_digests(self.runner.kv, block_ids)

    def _start(
        self,
        plan: ImportPlan,
        hold: list[int],
        tokens: list[int],
        mrope_delta: int,
        sampling: SamplingParams,
        generated: list[int],
    ) -> LmSequence:
        """The sequence owning the plan's blocks (computing the KV of resumed tokens), and
        the hold on the pulled blocks. If that fails, the plan's blocks go back here, on the
        model thread (the caller may have gone away meanwhile)."""
        try:
            seq = self.runner.resume(
                tokens, sampling, plan.blocks, generated, mrope_delta=mrope_delta
            )
        except BaseException:
            self.runner.allocator.abort_import(plan)
            raise
        self.runner.allocator.pool.acquire(hold)
        if len(generated) > 1:
            self.counters.resumed += 1
            self.counters.tokens_recomputed += len(generated) - 1
        return seq

    def _finish(self, imported: Imported) -> None:
        """Cache the pulled (verified, confirmed) blocks, then drop the hold on them."""
        allocator = self.runner.allocator
        try:
            allocator.finish_import(imported.plan, imported.hashes, imported.digests)
        finally:
            allocator.release(imported.hold)

    def _abandon(self, seq: LmSequence, hold: list[int]) -> None:
        """A sequence made for a request that went away: its blocks and the hold go back."""
        self.runner.allocator.release(seq.blocks)
        seq.blocks = []
        self.runner.allocator.release(hold)

    # ---------------------------------------------------------------------- helpers

    async def _refuse(
        self, handle: kv_pb2.KvHandle, plan: ImportPlan, mismatched: list[int]
    ) -> NoReturn:
        """Pulled blocks failed their digests: tell the holder which (it rechecks them),
        give every block back, raise ABORTED: the lease lost where the holder says it was
        gone (its blocks free to change: not corruption, nor the holder's fault), else the
        digests (counted)."""
        try:
            live = await self.peers.confirm_release_kv(
                handle.holder_address, handle.lease_id, mismatched
            )
        except asyncio.CancelledError:
            # A second release of a lease is harmless; this one may not have been sent.
            self.peers.release_kv(handle.holder_address, handle.lease_id)
            raise
        finally:
            await self.model.call(self.runner.allocator.abort_import, plan)
        if live is False:
            self.counters.leases_lost += 1
            raise lease_lost(handle, live)
        self.counters.digest_mismatches += len(mismatched)
        raise RpcStatusError(
            grpc.StatusCode.ABORTED,
            f"kv.block_digests: {len(mismatched)} pulled block(s) do not match their digests; "
            "nothing pulled is used, prefill again",
        )
