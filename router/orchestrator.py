"""One request through the pools: encode -> prefill -> decode, streamed back.

    run(job):
      route    block hashes of the prompt -> the prefill worker with the longest cached
               prefix among the least loaded (`router.prefix_index` follows each prefill
               worker's KV events); items whose every run lies inside that cached prefix
               need no encoding
      encode   the other items -> each to its content hash's encoder unless that one is
               much busier than the least loaded (`router.encode`); inline bytes and
               NIXL handles pass through unchanged, so a prefill worker pulls large
               embeddings straight from the encoder
      prefill  (prompt_token_ids, MultimodalParams + embeddings) -> that prefill worker ->
               first token + KvHandle (a lease pins the prompt's blocks); if the worker
               evicted blocks meanwhile and needs a skipped item after all
               (FAILED_PRECONDITION), every item is encoded and prefill runs once more
      stream   the first token goes to the client at once (that is the TTFT)
      decode   (prompt_token_ids, MultimodalParams without embeddings, first token,
               KvHandle) -> least loaded decode worker -> token id chunks after the first
               token, streamed on (its first chunk carries the KV transfer counts
               blocks_pulled / blocks_reused)

Text: the router owns it. Workers send token ids only; one incremental detokenizer per job
(`router.detokenize`) turns the whole answer, first token included, into text deltas.

Embedding leases (NIXL-held encoder outputs): the request tells the prefill worker which
encoder holds each (`embedding_holders`) and the prefill worker releases them once pulled;
if prefill is never reached or fails, the router releases them (a second release of the
same lease is ignored by the encoder).

Ownership of the KV lease: the decode worker takes it over with its first chunk (it has
pulled the blocks by then). Until that chunk arrives the router owns it: if decode is
never started, fails, or the client leaves or time runs out first, the router calls
`PrefillService.ReleaseKv` (in the background, so a cancelled request still frees it). A
worker call that fails with UNAVAILABLE before any of its output was used is tried once
more on another worker of the role.

Deadlines: every worker call gets the time left until the job's deadline; cancellation of
the caller cancels the in-flight call (unary calls through task cancellation, the decode
stream explicitly), so workers free what they hold.

Trusted KV: a decode worker that finds the pulled KV unusable (a block failed its digest, or
the lease was not live throughout the READ) answers ABORTED before its first chunk; the
router then prefills again (any prefill worker; the first token already sent is kept, as
the KV of the prompt does not depend on it) and decodes with the new handle, up to
`reprefills` times, so the client sees no error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from common.processing.processor import Processor
from common.sampling import StopChecker
from common.server.peers import PeerClient
from common.wire.convert import params_to_proto, sampling_to_proto
from common.wire.sampling import finish_reason_to_proto
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    multimodal_pb2,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    router_service_pb2,
)
from router.calls import Job, RouterError, WorkerCalls
from router.detokenize import IncrementalDetokenizer
from router.encode import Encoded, EncodeStage
from router.prefix_index import PrefixIndex
from router.registry import Registry
from router.workers import Role, WorkerRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillRoute:
    """Where a job's prefill goes and which items it will not need embeddings for."""

    worker: WorkerRecord | None  # the chosen prefill worker (None: pick at call time)
    skip: frozenset[int]  # items inside the worker's cached prefix: not encoded


@dataclass(slots=True)
class KvLease:
    """The prefill worker's lease on a prompt's KV blocks and who must release it."""

    lease_id: str  # from the KvHandle
    address: str  # prefill worker holding the blocks
    owned: bool = True  # False once the decode worker has taken it over (first chunk)


class Orchestrator:
    """Runs jobs across the registered workers; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        channels: PeerClient,
        processor: Processor,
        *,
        max_inline_embedding_bytes: int,
        attempts: int = 2,
        reprefills: int = 2,
        cache_aware: bool = True,
        encoder_affinity_slack: int = 2,
    ) -> None:
        self.registry = registry
        self.channels = channels  # worker channels and lease releases; the caller closes it
        self.processor = processor
        self.cache_aware = cache_aware
        self.reprefills = reprefills  # prefills again after decode refused the KV (ABORTED)
        self.stop = StopChecker(frozenset(processor.eos_token_ids))
        self.calls = WorkerCalls(registry, attempts)
        self.prefix = PrefixIndex(channels)
        self.encoder = EncodeStage(
            self.calls,
            channels,
            max_inline_embedding_bytes,
            affinity_slack=encoder_affinity_slack,
        )

    async def run(self, job: Job) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        """Stream the answer to `job`. The first chunk carries the first token with
        prompt_tokens and cached_tokens (it is sent before decode starts, so TTFT is the
        prefill's); the next chunk, the decode worker's first, carries blocks_pulled and
        blocks_reused (and possibly no tokens); the last one a finish reason. Raises
        RouterError."""
        handoff = params_to_proto(job.prompt.params)
        prefill, holder = await self._encode_and_prefill(job, handoff)
        detok = IncrementalDetokenizer(self.processor.decode)
        first = prefill.first_token_id
        finish = self.stop.check(job.sampling, first, 1)
        chunk = router_service_pb2.GenerateResponse(
            token_ids=[first],
            text=detok.add([first]),
            prompt_tokens=len(job.prompt.prompt_token_ids),
            cached_tokens=prefill.cached_tokens,
        )
        lease = KvLease(prefill.kv.lease_id, prefill.kv.holder_address or holder)
        try:
            if finish is not None:
                chunk.text += detok.flush()
                chunk.finish_reason = finish_reason_to_proto(finish)
                yield chunk
                return
            yield chunk
            async for out in self._decode(job, handoff, prefill, lease, detok):
                yield out
        finally:
            # Also when the client goes away at a `yield`, before decode ever starts.
            if lease.owned:
                self.channels.release_kv(lease.address, lease.lease_id)

    # -------------------------------------------------------------------------- stages

    def route(self, job: Job) -> PrefillRoute:
        """The prefill worker with the longest known cached prefix among the least loaded,
        and the items that prefix covers entirely (see the module docstring)."""
        items = job.prompt.params.items
        workers = [w for w in self.registry.workers(Role.PREFILL) if not w.draining]
        # The registry keeps every KV layout equal, so the first one roots every hash.
        layout = workers[0].layout if workers else None
        if not self.cache_aware or layout is None:
            return PrefillRoute(None, frozenset())
        for w in workers:
            self.prefix.track(w.address)
        tokens = job.prompt.prompt_token_ids
        try:
            hashes = block_hashes(
                tokens,
                layout.block_size,
                job.prompt.params,
                cache_salt=job.cache_salt,
                root=layout_root(layout),
            )
        except ValueError:
            return PrefillRoute(None, frozenset())
        worker = self.registry.pick(
            Role.PREFILL, affinity=lambda w: self.prefix.cached_prefix(w.address, hashes)
        )
        blocks = min(
            self.prefix.cached_prefix(worker.address, hashes),
            (len(tokens) - 1) // layout.block_size,
        )
        covered = blocks * layout.block_size
        return PrefillRoute(worker, frozenset(i for i, it in enumerate(items) if it.end <= covered))

    async def _encode_and_prefill(
        self, job: Job, handoff: multimodal_pb2.MultimodalParams
    ) -> tuple[prefill_service_pb2.PrefillResponse, str]:
        route = self.route(job)
        every = range(len(job.prompt.params.items))
        encoded = await self.encoder.encode(job, [i for i in every if i not in route.skip])
        try:
            try:
                return await self._prefill(job, handoff, encoded, route.worker)
            except RouterError as exc:
                if not route.skip or exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                logger.info(
                    "request %s: prefix cache moved on (%s); encoding all", job.request_id, exc
                )
            self.channels.release_embeddings(encoded.leases)
            encoded = await self.encoder.encode(job, list(every))
            return await self._prefill(job, handoff, encoded, None)
        except BaseException:
            # Prefill releases what it pulled; leases it never reached are freed here.
            self.channels.release_embeddings(encoded.leases)
            raise

    async def _prefill(
        self,
        job: Job,
        handoff: multimodal_pb2.MultimodalParams,
        encoded: Encoded,
        first: WorkerRecord | None,
    ) -> tuple[prefill_service_pb2.PrefillResponse, str]:
        multimodal = multimodal_pb2.MultimodalParams()
        multimodal.CopyFrom(handoff)
        multimodal.embeddings.extend(encoded.embeddings)
        request = prefill_service_pb2.PrefillRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt.prompt_token_ids,
            multimodal=multimodal,
            sampling=sampling_to_proto(job.sampling),
            embedding_holders=encoded.leases,
        )
        if job.cache_salt is not None:
            request.cache_salt = job.cache_salt
        holder = ""

        async def call(worker: WorkerRecord) -> prefill_service_pb2.PrefillResponse:
            nonlocal holder
            stub = prefill_service_pb2_grpc.PrefillServiceStub(self.channels.get(worker.address))
            response: prefill_service_pb2.PrefillResponse = await stub.Prefill(
                request, timeout=job.time_left("prefill")
            )
            holder = worker.address
            return response

        response = await self.calls.with_retry(Role.PREFILL, "prefill", call, first=first)
        return response, holder

    async def _decode(
        self,
        job: Job,
        handoff: multimodal_pb2.MultimodalParams,
        prefill: prefill_service_pb2.PrefillResponse,
        lease: KvLease,
        detok: IncrementalDetokenizer,
    ) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        request = decode_service_pb2.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt.prompt_token_ids,
            multimodal=handoff,
            sampling=sampling_to_proto(job.sampling),
            first_token_id=prefill.first_token_id,
            kv=prefill.kv,
        )
        if job.cache_salt is not None:
            request.cache_salt = job.cache_salt
        tried: set[str] = set()
        reprefills = 0
        while True:
            worker = self.calls.pick(Role.DECODE, tried)
            tried.add(worker.address)
            stub = decode_service_pb2_grpc.DecodeServiceStub(self.channels.get(worker.address))
            with self.registry.using(worker):
                call = stub.Decode(request, timeout=job.time_left("decode"))
                try:
                    async for response in call:
                        lease.owned = False  # the decode worker has it once it answers
                        yield self._chunk(response, detok)
                    return
                except grpc.aio.AioRpcError as exc:
                    refused_kv = exc.code() == grpc.StatusCode.ABORTED
                    if lease.owned and refused_kv and reprefills < self.reprefills:
                        reprefills += 1
                        tried.discard(worker.address)
                        logger.warning(
                            "request %s: decode on %s refused the KV (%s); prefilling again",
                            job.request_id,
                            worker.address,
                            exc.details(),
                        )
                        self.channels.release_kv(lease.address, lease.lease_id)
                        again, holder = await self._encode_and_prefill(job, handoff)
                        request.kv.CopyFrom(again.kv)
                        lease.lease_id = again.kv.lease_id
                        lease.address = again.kv.holder_address or holder
                        continue
                    if not lease.owned or not self.calls.retryable(exc, len(tried)):
                        raise self.calls.error("decode", worker, exc) from None
                    logger.warning(
                        "decode on %s failed (%s); trying another", worker.address, exc.code()
                    )
                finally:
                    call.cancel()

    def _chunk(
        self, response: decode_service_pb2.DecodeResponse, detok: IncrementalDetokenizer
    ) -> router_service_pb2.GenerateResponse:
        text = detok.add(response.token_ids)
        if response.finish_reason != decode_service_pb2.FINISH_REASON_UNSPECIFIED:
            text += detok.flush()
        return router_service_pb2.GenerateResponse(
            token_ids=response.token_ids,
            text=text,
            finish_reason=response.finish_reason,
            blocks_pulled=response.blocks_pulled,
            blocks_reused=response.blocks_reused,
        )

    async def close(self) -> None:
        """Stop following KV events (the peer client's owner closes it: releases finish)."""
        await self.prefix.close()
