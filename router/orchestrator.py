"""One request through the pools: encode -> prefill -> decode, streamed back.

    run(job):
      admit    the KV blocks the request needs on a prefill and a decode worker are
               reserved, or it waits in the router's bounded FIFO (`router.admission`);
               a prefill worker's RESOURCE_EXHAUSTED puts it back at the head of the queue
      route    block hashes of the prompt -> the prefill worker with the longest cached
               prefix among the least loaded (`router.routing`; `router.prefix_index`
               follows each prefill worker's KV events); items whose every run lies inside
               that cached prefix need no encoding, and of a partition-keyed video only
               the partitions past it are encoded and sent (`router.pieces.pieces_past`;
               the prefill worker takes the video as its pieces, `prefill_worker.partitions`)
      overlap  with `overlap_prefill`, items are encoded piece by piece (a video by spans
               of partitions) and the prefill worker computes the prompt up to the first
               piece not yet encoded as each arrives (`router.overlap`); prefill below
               reuses those blocks and needs no embeddings of the items inside them
      encode   the other items -> each to its content hash's encoder unless that one is
               much busier than the least loaded (`router.encode`); inline bytes and
               NIXL handles pass through unchanged, so a prefill worker pulls large
               embeddings straight from the encoder
      prefill  (prompt_token_ids, MultimodalParams + embeddings) -> that prefill worker ->
               first token + KvHandle (a lease pins the prompt's blocks); if the worker
               evicted blocks meanwhile and needs a skipped item or partition after all
               (FAILED_PRECONDITION), every item is encoded whole and prefill runs once more
      stream   the first token goes to the client at once (that is the TTFT)
      decode   (prompt_token_ids, MultimodalParams without embeddings, first token,
               KvHandle) -> the decode worker with the longest cached prefix among the
               least loaded (as prefill) -> token id chunks after the first token,
               streamed on (its first chunk carries the KV transfer counts blocks_pulled /
               blocks_reused); a stream that breaks mid-way resumes on another decode
               worker, token for token (`router.decode`)

Text: the router owns it. Workers send token ids only; one incremental detokenizer per job
(`router.detokenize`) turns the whole answer, first token included, into text deltas.

Embedding leases (NIXL-held encoder outputs): the prefill worker releases them once pulled
(`embedding_holders` names their encoders); the router, if prefill is never reached or fails.

Admission: the ticket's prefill reservation goes with the KV lease's ownership (the decode
worker's first chunk, or the router's ReleaseKv), its decode one when the stream ends; a
stage retried on another worker moves its reservation there.

Ownership of the KV lease: the router owns it from the Prefill call on, under an id it chose
(`PeerClient.prefill`: a call that ends without its answer releases that id, and a lease
released before it is made is never made), and the decode worker takes it over with its
first chunk (it has pulled the blocks by then). Until that chunk arrives the router owns it:
if decode is never started, fails, or the client leaves or time runs out first, the router
calls `PrefillService.ReleaseKv` (in the background, so a cancelled request still frees it).

Failures (`router.calls`): a worker call failing UNAVAILABLE before its output was used is
tried on another worker of the role (or, none left, one back from a restart), up to
`attempts` tries, then fails UNAVAILABLE naming the role. A failed prefill is retried with
its items encoded again; on the same worker when an embedding's encoder is gone.

Deadlines: every worker call gets the time left until the job's deadline; a caller that
cancels cancels the call in flight, so workers free what they hold.

Trusted KV: a decode worker that finds the pulled KV unusable (a block failed its digest,
the lease was not live throughout the READ, or the holder is gone) answers ABORTED before
its first chunk; the router then prefills again (any prefill worker; the first token sent
is kept: the prompt's KV does not depend on it) and decodes with the new handle, up to
`reprefills` times, so the client sees no error.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable

import grpc

from common.handoff import EMBEDDINGS_LOST
from common.kv.block_pool import pool_full
from common.processing.processor import Processor
from common.sampling import StopChecker
from common.server.peers import PeerClient
from common.wire.convert import params_to_proto
from common.wire.sampling import finish_reason_to_proto, sampling_to_proto
from epd.v1 import decode_service_pb2, multimodal_pb2, prefill_service_pb2, router_service_pb2
from router.admission import Admission, Ticket
from router.calls import Job, KvPoolFull, RouterError, TooLarge, WorkerCalls
from router.decode import DecodeStage, KvLease
from router.detokenize import IncrementalDetokenizer
from router.encode import Encoded, EncodeStage, log_stages
from router.metrics import RouterMetrics
from router.overlap import OverlappedPrefill
from router.pieces import cached_tokens, partitions_past
from router.prefix_index import PrefixIndex
from router.registry import Registry
from router.routing import Chooser, PrefillRouting
from router.workers import NoWorkerError, Role, WorkerRecord

logger = logging.getLogger(__name__)


class Orchestrator:
    """Runs jobs across the registered workers; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        channels: PeerClient,
        processor: Processor,
        *,
        max_inline_embedding_bytes: int,
        attempts: int = 3,
        reprefills: int = 2,
        migrations: int = 2,
        cache_aware: bool = True,
        overlap_prefill: bool = False,
        encoder_affinity_slack: int = 2,
        kv_affinity_slack: int = 2,
        max_queued_requests: int = 512,
        max_queue_wait_s: float = 60.0,
        embedding_cache_bytes: int = 0,
        tenant_share: float = 1.0,
    ) -> None:
        self.registry = registry
        self.channels = channels  # worker channels and lease releases; the caller closes it
        self.processor = processor
        self.stop = StopChecker(frozenset(processor.config.eos_token_ids))  # as the workers
        self.calls = WorkerCalls(registry, attempts, channels)
        self.prefix = PrefixIndex(channels)
        self.routing = PrefillRouting(registry, self.prefix, cache_aware, kv_affinity_slack)
        self.admission = Admission(
            registry,
            max_queued=max_queued_requests,
            max_wait_s=max_queue_wait_s,
            tenant_share=tenant_share,
        )
        self.encoder = EncodeStage(
            self.calls,
            channels,
            max_inline_embedding_bytes,
            affinity_slack=encoder_affinity_slack,
            embedding_cache_bytes=embedding_cache_bytes,
        )
        self.metrics = RouterMetrics(  # the router's registry
            self.admission, self.calls, self.encoder.embeddings, processor.image_cache
        )
        self.decode = DecodeStage(
            registry,
            self.calls,
            channels,
            self.admission,
            self.metrics,
            reprefills=reprefills,
            migrations=migrations,
        )
        # Prefills the prompt as its items' pieces are encoded (`router.overlap`).
        self.overlap = (
            OverlappedPrefill(registry, channels, self.encoder) if overlap_prefill else None
        )

    async def run(self, job: Job) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        """Stream the answer to `job`. The first chunk carries the first token with
        prompt_tokens and cached_tokens (it is sent before decode starts, so TTFT is the
        prefill's); the next chunk, the decode worker's first, carries blocks_pulled and
        blocks_reused (and possibly no tokens); the last one a finish reason. Raises
        RouterError."""
        handoff = params_to_proto(job.prompt.params)
        planning = time.perf_counter()
        hashes = self.routing.hashes(job)
        self.metrics.planning.labels("hash").observe(time.perf_counter() - planning)
        choose = self.routing.chooser(hashes)  # the route reuses its cached prefixes
        ticket = await self.admission.admit(
            len(job.prompt.prompt_token_ids),
            job.sampling.max_tokens,
            job.deadline,
            choose,
            job.tenant,
            job.prompt_field,
            job.default_length,
        )
        try:
            prefill, holder = await self._prefill_admitted(job, handoff, choose, ticket)
        except BaseException:
            self.admission.release(ticket)
            raise
        detok = IncrementalDetokenizer.of_answer(self.processor, job.sampling, job.resumed)
        first = prefill.first_token_id
        finish = self.stop.check(job.sampling, first, 1)
        if job.resumed:  # the client has these: keep its first token, send what follows
            first, finish = job.resumed[0], None
        chunk = router_service_pb2.GenerateResponse(
            token_ids=[first],
            text="" if job.resumed else detok.add([first]),  # a resumed one is not sent
            prompt_tokens=len(job.prompt.prompt_token_ids),
            cached_tokens=prefill.cached_tokens,
        )
        lease = KvLease.of(prefill, holder)
        try:
            if finish is not None:
                chunk.text += detok.flush()
                chunk.finish_reason = finish_reason_to_proto(finish)
                yield chunk
                return
            if not job.resumed:
                yield chunk
            request = decode_service_pb2.DecodeRequest(
                request_id=job.request_id,
                prompt_token_ids=job.prompt.prompt_token_ids,
                multimodal=handoff,
                sampling=sampling_to_proto(job.sampling),
                first_token_id=first,
                kv=prefill.kv,
            )
            if job.cache_salt is not None:
                request.cache_salt = job.cache_salt

            def prefill_again() -> Awaitable[tuple[prefill_service_pb2.PrefillResponse, str]]:
                return self._prefill_admitted(job, handoff, self.routing.chooser(hashes), ticket)

            echo = len(job.resumed)  # a resumed stream's first chunk says so
            async for out in self.decode.stream(
                job, request, lease, detok, ticket, prefill_again, resumed=job.resumed
            ):
                out.resumed_tokens, echo = echo, 0
                yield out
        except TooLarge as exc:  # a decode worker's own: its pool was not heartbeated yet
            raise ticket.need.as_admission_would(exc) from None
        finally:
            # Also when the client goes away at a `yield`, before decode ever starts.
            if lease.owned:
                self.channels.release_kv(lease.address, lease.lease_id)
            self.admission.release(ticket)

    # -------------------------------------------------------------------------- stages

    async def _prefill_admitted(
        self,
        job: Job,
        handoff: multimodal_pb2.MultimodalParams,
        choose: Chooser,
        ticket: Ticket,
    ) -> tuple[prefill_service_pb2.PrefillResponse, str]:
        """Encode and prefill on the ticket's prefill worker (`choose`: the choice that
        placed it, over the prompt's block hashes); when a prefill worker's pool is full
        after all, back in the admission queue and again (see `router.admission`)."""
        while True:
            try:
                return await self._encode_and_prefill(job, handoff, choose, ticket)
            except TooLarge as exc:  # the worker's own: its pool was not heartbeated yet
                raise ticket.need.as_admission_would(exc) from None
            except KvPoolFull as exc:
                logger.info("request %s: %s; queued again", job.request_id, exc)
                refused = exc.address
            choose = self.routing.chooser(choose.hashes)  # the caches moved meanwhile
            await self.admission.requeue(ticket, choose, refused)

    async def _encode_and_prefill(
        self,
        job: Job,
        handoff: multimodal_pb2.MultimodalParams,
        choose: Chooser,
        ticket: Ticket,
    ) -> tuple[prefill_service_pb2.PrefillResponse, str]:
        """Encode and prefill; a prefill worker that fails with UNAVAILABLE (dead, or an
        embedding's encoder is: `EMBEDDINGS_LOST`) is retried with the items encoded again
        (its embedding leases may be released already), on another prefill worker (or one
        back from a restart) unless only the encoder was lost, up to `calls.attempts` tries."""
        failed: set[str] = set()  # prefill workers that failed under this request
        tries = 0
        overlap = True  # off once embeddings were lost: read each output as soon as it is in
        while True:
            tries += 1
            try:
                return await self._encode_and_prefill_on(
                    job, handoff, choose, ticket, failed, overlap, count_retry=tries > 1
                )
            except RouterError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE or exc.stage != "prefill":
                    raise
                if tries >= self.calls.attempts:
                    raise
                lost_embeddings = EMBEDDINGS_LOST in str(exc)
                if not lost_embeddings:
                    failed.add(exc.address)  # none left: wait for one back from a restart
                    pick = functools.partial(self.calls.pick, Role.PREFILL, failed)
                    await self.calls.pick_or_return(Role.PREFILL, failed, job.deadline, pick)
                else:  # outputs that waited for later pieces outlived their leases
                    overlap = False
                logger.warning(
                    "request %s: %s; prefilling again%s%s",
                    job.request_id,
                    exc,
                    "" if lost_embeddings else " (on another worker, or one back from a restart)",
                    ", media not cached encoded again" if job.prompt.params.items else "",
                )

    async def _encode_and_prefill_on(
        self,
        job: Job,
        handoff: multimodal_pb2.MultimodalParams,
        choose: Chooser,
        ticket: Ticket,
        failed: set[str],
        overlap: bool = True,
        count_retry: bool = False,
    ) -> tuple[prefill_service_pb2.PrefillResponse, str]:
        planning = time.perf_counter()
        worker = ticket.workers.get(Role.PREFILL)  # None once released (a stream resumed)
        if worker is not None and (worker.address in failed or worker.suspect):
            worker = None  # chosen again (a suspect one only when no other is left)
        if worker is None and (failed or choose.hashes is not None):
            # By cached prefix here (without hashes `_prefill` picks by load, at call time).
            try:
                worker = choose(Role.PREFILL, frozenset(failed))
            except NoWorkerError:
                self.calls.pick(Role.PREFILL, failed)  # raises UNAVAILABLE naming the role
                raise
        route = self.routing.route(job, choose.hashes, worker, choose)
        self.metrics.planning.labels("route").observe(time.perf_counter() - planning)
        every = range(len(job.prompt.params.items))
        to_encode = [i for i in every if i not in route.skip]
        encoding = time.perf_counter()
        past = partitions_past(job.prompt.params.items, to_encode, cached_tokens(route))
        if self.overlap is not None and overlap:  # skips the same partitions (`pieces_past`)
            encoded = await self.overlap.encode(job, route, to_encode)
        else:
            encoded = await self.encoder.encode(job, to_encode, past)
        prefilling = time.perf_counter()
        try:
            try:
                out = await self._prefill(
                    job, handoff, encoded, route.worker, ticket, failed, count_retry
                )
                log_stages(job, encoded, prefilling - encoding, prefilling, out[0])
                # Counted once the prefill took them so (its fallback encodes them all).
                self.metrics.items_skipped.inc(len(route.skip))
                self.metrics.partitions_skipped.inc(sum(past.values()))
                return out
            except RouterError as exc:
                spans = any(emb.HasField("partition_start") for emb in encoded.embeddings)
                every_item_carried = len(encoded.embeddings) == len(every) and not spans
                if every_item_carried or exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                logger.info(
                    "request %s: prefix cache moved on (%s); encoding all", job.request_id, exc
                )
            self.channels.release_embeddings(encoded.leases)
            encoded = await self.encoder.encode(job, list(every))
            return await self._prefill(job, handoff, encoded, None, ticket, failed)
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
        ticket: Ticket,
        failed: set[str],
        count_retry: bool = False,
    ) -> tuple[prefill_service_pb2.PrefillResponse, str]:
        """One Prefill call (on `first`, or the best worker not in `failed`): retrying it
        is the caller's, with the items encoded again (`count_retry`: this call is that retry,
        counted once it has a worker). Raises RouterError."""
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
            if count_retry:
                self.calls.retries["prefill"] += 1
            self.admission.move(ticket, Role.PREFILL, worker)
            timeout = job.time_left("prefill")
            response = await self.channels.prefill(worker.address, request, timeout)
            holder = worker.address
            return response

        try:
            response = await self.calls.with_retry(
                Role.PREFILL, "prefill", call, first=first, exclude=failed, attempts=1
            )
        except RouterError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and pool_full(str(exc)):
                raise KvPoolFull.of(exc) from None
            raise
        return response, holder

    async def close(self) -> None:
        """Stop following KV events (the peer client's owner closes it: releases finish)."""
        await self.prefix.close()
