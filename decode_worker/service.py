"""`DecodeService.Decode`: verify the KV handle, pull what is missing, stream the answer.

Per request:
1. validate the handoff (INVALID_ARGUMENT naming the field) and the handle against this
   worker (`common.handoff.check_handle`): a signature that does not verify under the
   cluster key is PERMISSION_DENIED, a different KV layout or a handle made for another
   prompt (its `prompt_digest`, over every token, differs) FAILED_PRECONDITION;
2. recompute the block hashes from the handoff under this worker's root; a handle whose
   hashes differ is refused with FAILED_PRECONDITION and nothing enters the cache;
3. take the KV (`decode_worker.kv_import`): blocks (`KvAllocator.plan_import`; while the
   pool is full, wait for blocks to be freed and keep the lease alive with `RenewKv`) and
   pull at once (before waiting for a batch slot): full prompt blocks whose hashes this
   worker caches are reused, the others plus the partial last block are pulled by one NIXL
   READ and their bytes checked against the handle's `block_digests`; then `ReleaseKv` on
   the holder confirms the lease was live throughout. That round trip runs while the
   sequence already decodes; only after it does the stream send anything, and do the pulled
   full blocks enter this worker's prefix cache. If a digest differs or the lease was gone,
   nothing pulled is used or cached and the call fails with ABORTED (the router prefills
   again; the client sees no error). A resumed stream (`resume_tokens`: the tokens another
   decode worker had streamed before it failed) gets their KV computed after the prompt's,
   and continues from there;
4. wait for a batch slot, join the continuous-batching loop and stream `DecodeResponse`
   chunks of token ids (the router owns the text). The stream never repeats the prefill's
   first token, which the caller already has: the first chunk carries `blocks_pulled` /
   `blocks_reused` (sent once the lease is confirmed) and the tokens sampled meanwhile
   (possibly none); the last carries `finish_reason`. When the first token already ends
   the answer, the stream is one chunk with no tokens and the finish reason. If a decode
   step fails (`DecodeStepError`: the loop released the batch's blocks and goes on), the
   stream ends with UNAVAILABLE after the tokens sampled before it, so the router resumes
   the answer on another decode worker.

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
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.handoff import check_handle, check_request, read_handoff
from common.kv.events import KvEventHub
from common.models import batching
from common.models.decode_loop import Chunk, DecodeBatcher, DecodeStepError
from common.server.kv_worker import KvWorkerParts, kv_load, stream_kv_events
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError, logged, rpc_errors
from common.wire.kv import kv_event_to_proto
from common.wire.sampling import finish_reason_to_proto, sampling_from_proto
from decode_worker.kv_import import DecodeCounters, KvImporter, lease_lost
from decode_worker.resume import resume_tokens
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    registry_service_pb2,
)

logger = logging.getLogger(__name__)


class DecodeServicer(decode_service_pb2_grpc.DecodeServiceServicer):
    """The decode worker's RPC; see the module docstring for the contracts.

    Registers the runner's KV buffer with `agent` once, here (the READ destination).
    """

    def __init__(
        self,
        parts: KvWorkerParts,
        *,
        max_batch: int = 32,
        stream_interval: int = 1,
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
        self.batcher = DecodeBatcher(runner, model, stream_interval=stream_interval)
        self.counters = DecodeCounters()
        self.active = 0  # Decode RPCs in flight
        self._slots = asyncio.Semaphore(max_batch)
        # ReleaseKv / RenewKv to prefill, presenting `credentials` (the cluster bearer).
        self._peers = PeerClient(release_timeout_s=release_timeout_s, credentials=credentials)
        # Blocks, READ, digests and lease of each request's KV.
        self.importer = KvImporter(
            runner,
            model,
            agent,
            self._peers,
            self.counters,
            self.batcher.freed,
            renew_leases=renew_leases,
        )
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
        started = time.perf_counter()
        tokens = list(request.prompt_token_ids)
        sampling = sampling_from_proto(request.sampling)
        check_request(self.runner, tokens, sampling, request)
        # On the loop's thread: without embeddings nothing is pulled, and the check (about
        # 0.2 ms for an image prompt) costs less than a hop to a worker thread on a busy host.
        handoff = read_handoff(runner, tokens, request.multimodal, with_embeddings=False)
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
        admitting = time.perf_counter()
        imported = await self.importer.admit(
            handle,
            tokens,
            hashes,
            generated,
            handoff.positions.delta,
            sampling,
            max(pull_timeout_s, 1e-3),
        )
        joined = False  # the decode loop owns the sequence's blocks
        admitted = time.perf_counter()
        try:
            await self._slots.acquire()
            try:
                entry = self.batcher.add(imported.seq)
                joined = True
                finished = False
                try:
                    live = await self.importer.confirmed(imported)
                    if not live:
                        # Nothing computed from the pulled bytes has left this worker.
                        await self.batcher.drop(entry)
                        gone = self.importer.discard(imported)
                        if gone is not None:
                            await asyncio.wrap_future(gone)
                        raise lease_lost(handle, live)
                    # Sent at once, so the caller learns that this worker has the KV (and
                    # the lease is released) now, with the tokens stepped meanwhile; before
                    # a step's failure too, or the caller would hand the released lease to
                    # another worker and suspect its holder (kvimport review).
                    try:
                        head = entry.ready() or Chunk([], None)
                    except DecodeStepError:
                        yield decode_service_pb2.DecodeResponse(
                            blocks_pulled=len(imported.plan.pull),
                            blocks_reused=len(imported.plan.reused),
                        )
                        raise
                    finished = head.finish_reason is not None
                    logger.debug(
                        "request %s: checks and hashes %.1f ms, admit (%d blocks pulled, %d "
                        "reused) %.1f ms, joined and confirmed %.1f ms",
                        logged(request.request_id),
                        (admitting - started) * 1000,
                        len(imported.plan.pull),
                        len(imported.plan.reused),
                        (admitted - admitting) * 1000,
                        (time.perf_counter() - admitted) * 1000,
                    )
                    yield decode_service_pb2.DecodeResponse(
                        token_ids=head.token_ids,
                        finish_reason=finish_reason_to_proto(head.finish_reason),
                        blocks_pulled=len(imported.plan.pull),
                        blocks_reused=len(imported.plan.reused),
                    )
                    while not finished:
                        chunk = await entry.next_chunk()
                        finished = chunk.finish_reason is not None
                        yield decode_service_pb2.DecodeResponse(
                            token_ids=chunk.token_ids,
                            finish_reason=finish_reason_to_proto(chunk.finish_reason),
                        )
                except DecodeStepError as exc:
                    raise RpcStatusError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
                finally:
                    if not finished:
                        self.batcher.cancel(entry)
            finally:
                self._slots.release()
        finally:
            if not joined:
                self.model.submit(batching.release, runner, imported.seq)
            self.importer.discard(imported)  # nothing once confirmed

    # --------------------------------------------------------------------------- stop

    async def close(self) -> None:
        """Stop the decode loop (freeing running sequences), finish releases, close channels."""
        await self.batcher.stop()
        await self._peers.close()

    # --------------------------------------------------------------------------- load

    def load(self) -> registry_service_pb2.WorkerLoad:
        """Heartbeat load: streams in flight, KV blocks, prefix-cache hits and lookups."""
        return kv_load(self.runner, self.active, self.lifecycle)
