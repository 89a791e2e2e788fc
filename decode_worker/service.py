"""`DecodeService.Decode`: verify the KV handle, pull what is missing, stream the answer.

Per request:
1. validate the handoff (INVALID_ARGUMENT naming the field) and the handle against this
   worker (`common.handoff.check_handle`): a signature that does not verify under the
   cluster key is PERMISSION_DENIED, a different KV layout or a handle made for another
   prompt (its `prompt_digest`, over every token, differs) FAILED_PRECONDITION;
2. recompute the block hashes from the handoff under this worker's root; a handle whose
   hashes differ is refused with FAILED_PRECONDITION and nothing enters the cache;
3. take blocks (`KvAllocator.plan_import`; while the pool is full, wait for blocks to be
   freed and keep the lease alive with `RenewKv`) and pull at once (before waiting for a
   batch slot): full prompt blocks whose hashes this worker caches are reused, the others plus
   the partial last block are pulled by one NIXL READ and their bytes checked against the
   handle's `block_digests`; then `ReleaseKv` on the holder confirms the lease was live
   throughout. Only then do the pulled full blocks enter this worker's prefix cache. If a
   digest differs or the lease was gone, nothing pulled is used or cached and the call
   fails with ABORTED (the router prefills again; the client sees no error);
   A resumed stream (`resume_tokens`: the tokens another decode worker had streamed before
   it failed) gets their KV computed after the prompt's, and continues from there;
4. wait for a batch slot, join the continuous-batching loop and stream `DecodeResponse`
   chunks of token ids (the router owns the text). The stream never repeats the prefill's
   first token, which the caller already has: the first chunk carries `blocks_pulled` /
   `blocks_reused` and the tokens after the first one (possibly none); the last carries
   `finish_reason`. When the first token already ends the answer, the stream is one chunk
   with no tokens and the finish reason.

`StreamDecodeKvEvents` streams this worker's prefix-cache changes exactly as prefill's
`StreamKvEvents` does (`common.kv.events`): the router follows them to send a request to
the decode worker that already holds most of its prompt (`router.routing`).

Leases: once the handle has been checked this worker owns the duty to release the lease
exactly once (the confirming `ReleaseKv` after the READ, or a background one on every other
path). A request refused before that (bad handoff, bad handle, hash mismatch) leaves the
lease to the caller (the router releases it, or it expires on the prefill worker).

Cancellation (client cancel, deadline): blocks taken for the request go back to the pool —
at once before the READ starts, after the READ finishes if it is in flight, and at the
decode loop's next step once the sequence is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from common.handoff import Pulled, check_handle, check_request, pull, read_handoff
from common.kv.allocator import ImportPlan
from common.kv.block_pool import NoFreeBlocksError
from common.kv.events import KvEventHub
from common.models import batching
from common.models.batching import DecodeBatcher
from common.models.sequence import LmSequence
from common.sampling import SamplingParams
from common.server.kv_worker import KvWorkerParts, kv_load, stream_kv_events
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError, rpc_errors
from common.transfer.types import TransferTimeoutError
from common.wire.convert import sampling_from_proto
from common.wire.kv import kv_event_to_proto
from common.wire.sampling import finish_reason_to_proto
from decode_worker.resume import resume_tokens
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    kv_pb2,
    registry_service_pb2,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeCounters:
    """What the decode worker did since start (tests, heartbeats, logs)."""

    requests: int = 0  # Decode streams admitted (past validation)
    blocks_pulled: int = 0  # prompt blocks READ from prefill workers
    bytes_pulled: int = 0  # bytes READ from prefill workers
    blocks_reused: int = 0  # full prompt blocks found in this worker's prefix cache
    hash_mismatches: int = 0  # handles refused because their hashes differ
    digest_mismatches: int = 0  # pulled blocks whose bytes failed their digest (re-prefilled)
    leases_lost: int = 0  # pulls discarded because the lease was not live throughout
    lease_renewals: int = 0  # RenewKv calls made while waiting for free blocks
    block_waits: int = 0  # requests that waited for free blocks before their pull
    resumed: int = 0  # streams resumed from another decode worker's tokens (resume_tokens)
    tokens_recomputed: int = 0  # KV of resumed tokens computed here
    pull_seconds: float = 0.0  # wall time spent in READs


class DecodeServicer(decode_service_pb2_grpc.DecodeServiceServicer):
    """The decode worker's RPC; see the module docstring for the contracts.

    Registers the runner's KV buffer with `agent` once, here (the READ destination).
    """

    def __init__(
        self,
        parts: KvWorkerParts,
        *,
        max_batch: int = 32,
        pull_timeout_s: float = 30.0,
        release_timeout_s: float = 5.0,
        renew_leases: bool = True,
    ) -> None:
        self.runner = runner = parts.runner
        self.model = model = parts.model
        self.agent = agent = parts.agent
        self.lifecycle = parts.lifecycle
        self.key = parts.key  # verifies every KvHandle's signature; None: insecure, unchecked
        credentials = parts.credentials
        self.pull_timeout_s = pull_timeout_s
        self.release_timeout_s = release_timeout_s
        self.renew_leases = renew_leases  # RenewKv while a request waits for blocks
        self.batcher = DecodeBatcher(runner, model)
        self.counters = DecodeCounters()
        self.active = 0  # Decode RPCs in flight
        self._slots = asyncio.Semaphore(max_batch)
        # Releasekv to prefill, presenting `credentials` (the cluster bearer).
        self._peers = PeerClient(release_timeout_s=release_timeout_s, credentials=credentials)
        # Prefix-cache changes for the router's decode routing (`StreamDecodeKvEvents`).
        self.hub = KvEventHub(runner.allocator)
        agent.register(runner.kv.buffer)

    # -------------------------------------------------------------------------- Decode

    @rpc_errors
    async def Decode(
        self, request: decode_service_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_service_pb2.DecodeResponse]:
        async with self.lifecycle.track():
            self.active += 1
            try:
                async for chunk in self._decode(request, context.time_remaining()):
                    yield chunk
            finally:
                self.active -= 1

    @rpc_errors
    async def StreamDecodeKvEvents(
        self,
        request: decode_service_pb2.StreamDecodeKvEventsRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[decode_service_pb2.StreamDecodeKvEventsResponse]:
        async for events in stream_kv_events(self.hub, self.model, request.subscriber):
            yield decode_service_pb2.StreamDecodeKvEventsResponse(
                events=[kv_event_to_proto(e) for e in events]
            )

    async def _decode(
        self, request: decode_service_pb2.DecodeRequest, time_left_s: float | None
    ) -> AsyncIterator[decode_service_pb2.DecodeResponse]:
        runner = self.runner
        tokens = list(request.prompt_token_ids)
        sampling = sampling_from_proto(request.sampling)
        check_request(self.runner, tokens, sampling, request)
        handoff = await asyncio.to_thread(
            read_handoff, runner, tokens, request.multimodal, with_embeddings=False
        )
        first = request.first_token_id
        if not 0 <= first < runner.config.text.vocab_size:
            raise RpcStatusError(
                grpc.StatusCode.INVALID_ARGUMENT, f"first_token_id: {first} outside the vocab"
            )
        generated = [first, *resume_tokens(runner, request, sampling)]
        if not request.HasField("kv"):
            raise RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, "kv: missing")
        handle = request.kv
        salt = request.cache_salt if request.HasField("cache_salt") else None
        lora = request.lora_id if request.HasField("lora_id") else None
        allocator = runner.allocator
        digest = allocator.prompt_digest(tokens, handoff.params, cache_salt=salt, lora_id=lora)
        check_handle(handle, runner, len(tokens), prompt_digest=digest, key=self.key)
        hashes = allocator.hashes(tokens, handoff.params, cache_salt=salt, lora_id=lora)
        if (hashes or []) != list(handle.block_hashes):
            self.counters.hash_mismatches += 1
            raise RpcStatusError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"kv.block_hashes: the handle's {len(handle.block_hashes)} block hashes differ "
                f"from the {len(hashes or [])} recomputed from the handoff; refusing the KV",
            )
        self.counters.requests += 1
        # From here on this worker owns releasing the lease (once, whatever happens).
        reason = None if len(generated) > 1 else runner.stop.check(sampling, first, 1)
        if reason is not None:
            # The first token already ends the answer: nothing to pull, nothing to add.
            self._peers.release_kv(handle.holder_address, handle.lease_id)
            yield decode_service_pb2.DecodeResponse(finish_reason=finish_reason_to_proto(reason))
            return
        pull_timeout_s = min(self.pull_timeout_s, time_left_s or self.pull_timeout_s)
        seq, plan = await self._admit(
            request,
            tokens,
            generated,
            handoff.positions.delta,
            sampling,
            hashes,
            max(pull_timeout_s, 1e-3),
        )
        try:
            await self._slots.acquire()
        except BaseException:
            self.model.submit(batching.release, runner, seq)
            raise
        try:
            entry = self.batcher.add(seq)
            finished = False
            try:
                # Sent before any new token so the caller learns at once that this worker
                # has the KV (and the lease is released) now.
                yield decode_service_pb2.DecodeResponse(
                    blocks_pulled=len(plan.pull), blocks_reused=len(plan.reused)
                )
                while not finished:
                    chunk = await entry.next_chunk()
                    finished = chunk.finish_reason is not None
                    yield decode_service_pb2.DecodeResponse(
                        token_ids=chunk.token_ids,
                        finish_reason=finish_reason_to_proto(chunk.finish_reason),
                    )
            finally:
                if not finished:
                    self.batcher.cancel(entry)
        finally:
            self._slots.release()

    async def _admit(
        self,
        request: decode_service_pb2.DecodeRequest,
        tokens: list[int],
        generated: list[int],
        mrope_delta: int,
        sampling: SamplingParams,
        hashes: list[bytes] | None,
        pull_timeout_s: float,
    ) -> tuple[LmSequence, ImportPlan]:
        """Take blocks, pull and verify the missing ones, confirm the lease, make the
        sequence (owning the blocks). Releases the lease in every case.

        On failure or cancellation every block taken goes back to the pool (after the READ
        has finished, if one is in flight), except after an uncancellable READ timeout: NIXL
        may still write those blocks, so they are quarantined (never handed out again).
        Raises ABORTED (the router prefills again) when a pulled block fails its digest or
        the lease was not live until the READ was confirmed.
        """
        runner = self.runner
        allocator = runner.allocator
        handle = request.kv
        total = len(tokens) + sampling.max_tokens - 1
        try:
            plan = await self._plan(hashes, len(tokens), total, handle)
        except BaseException:
            self._peers.release_kv(handle.holder_address, handle.lease_id)
            raise
        released = False  # the lease's one release has been made
        pulled: Pulled | None = None  # set once the READ is over
        try:
            pulled = await pull(
                self.agent,
                runner,
                handle,
                plan,
                timeout_s=pull_timeout_s,
                on_orphan=lambda: self.model.submit(allocator.abort_import, plan),
            )
            if pulled.stats is None:
                released = True
                self._peers.release_kv(handle.holder_address, handle.lease_id)
                live = True  # nothing READ: no byte read under the lease is used
            else:
                live = await self._peers.confirm_release_kv(
                    handle.holder_address, handle.lease_id, pulled.mismatched
                )
                released = True
        except asyncio.CancelledError:
            if not released:  # a second release of a lease is harmless
                self._peers.release_kv(handle.holder_address, handle.lease_id)
            if pulled is not None:  # cancelled while confirming: the READ is over
                self.model.submit(allocator.abort_import, plan)
            raise  # else on_orphan gives the blocks back once the READ is over
        except TransferTimeoutError as exc:
            self._peers.release_kv(handle.holder_address, handle.lease_id)
            if exc.cancelled:
                await self.model.call(allocator.abort_import, plan)
            else:
                logger.error(
                    "KV READ timed out and could not be cancelled; quarantining %d blocks",
                    len(plan.blocks),
                )
            raise
        except BaseException:
            if not released:
                self._peers.release_kv(handle.holder_address, handle.lease_id)
            await self.model.call(allocator.abort_import, plan)
            raise
        c = self.counters
        if pulled.mismatched or not live:
            await self.model.call(allocator.abort_import, plan)
            if pulled.mismatched:
                c.digest_mismatches += len(pulled.mismatched)
                what = (
                    f"kv.block_digests: {len(pulled.mismatched)} pulled block(s) do not match "
                    "their digests"
                )
            else:
                c.leases_lost += 1
                what = (
                    f"kv.lease_id: the lease on {handle.holder_address} was not live until the "
                    "READ was confirmed"
                )
            raise RpcStatusError(
                grpc.StatusCode.ABORTED, what + "; nothing pulled is used, prefill again"
            )
        c.blocks_pulled += len(plan.pull)
        c.blocks_reused += len(plan.reused)
        if pulled.stats is not None:
            c.bytes_pulled += pulled.stats.nbytes
            c.pull_seconds += pulled.stats.seconds
        seq = await self.model.call(
            self._start,
            plan,
            hashes,
            list(handle.block_digests),
            tokens,
            mrope_delta,
            sampling,
            generated,
            on_orphan=lambda s: self.model.submit(batching.release, runner, s),
        )
        return seq, plan

    def _start(
        self,
        plan: ImportPlan,
        hashes: list[bytes] | None,
        digests: list[bytes],
        tokens: list[int],
        mrope_delta: int,
        sampling: SamplingParams,
        generated: list[int],
    ) -> LmSequence:
        """Model thread: cache the pulled (verified) blocks, then the sequence owning them
        (computing the KV of resumed tokens)."""
        self.runner.allocator.finish_import(plan, hashes, digests)
        if len(generated) > 1:
            self.counters.resumed += 1
            self.counters.tokens_recomputed += len(generated) - 1
        return self.runner.resume(tokens, sampling, plan.blocks, generated, mrope_delta=mrope_delta)

    async def _plan(
        self, hashes: list[bytes] | None, n: int, total: int, handle: kv_pb2.KvHandle
    ) -> ImportPlan:
        """`plan_import`, waiting for blocks to be freed when the pool is full (renewing the
        handle's lease meanwhile, every third of its lifetime; the caller's deadline bounds
        the wait); RESOURCE_EXHAUSTED (NoFreeBlocksError) when no block is in use, so none
        will be freed (the request needs more than the whole pool)."""
        renew_every_s = max(handle.lease_ttl_ms / 3000, 0.05)
        renewed = time.monotonic()
        waited = False
        while True:
            try:
                return await self.model.call(
                    self.runner.allocator.plan_import,
                    hashes,
                    n,
                    total,
                    on_orphan=lambda p: self.model.submit(self.runner.allocator.abort_import, p),
                )
            except NoFreeBlocksError:
                if self.runner.allocator.pool.num_used_blocks == 0:
                    raise
            if not waited:
                waited = True
                self.counters.block_waits += 1
                logger.info("a request waits for free KV blocks (lease %s)", handle.lease_id)
            if self.renew_leases and time.monotonic() - renewed >= renew_every_s:
                renewed = time.monotonic()
                self.counters.lease_renewals += 1
                self._peers.renew_kv(handle.holder_address, handle.lease_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.batcher.wait_freed(), renew_every_s)

    # --------------------------------------------------------------------------- stop

    async def close(self) -> None:
        """Stop the decode loop (freeing running sequences), finish releases, close channels."""
        await self.batcher.stop()
        await self._peers.close()

    # --------------------------------------------------------------------------- load

    def load(self) -> registry_service_pb2.WorkerLoad:
        """Heartbeat load: streams in flight, KV blocks, prefix-cache hits and lookups."""
        return kv_load(self.runner, self.active, self.lifecycle)
