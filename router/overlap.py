"""Encoding overlapped with prefill: the prefill worker takes each item's (each video
partition's) embeddings as they arrive (router setting `overlap_prefill`, off by
default).

    pieces   the items to encode, split into pieces (`router.pieces.batched`): a whole
             item, or a span of a partition-keyed video's partitions (small at both ends
             of the video, larger between); encoded in prompt order, one `Encode` call
             each, at most `DEPTH` in flight, so the encoder works on one piece while the
             previous one travels and each arrives as soon as it is done (the encoder
             batches no two calls of one request id together: `EncoderEngine._take_batch`)
    steps    a step is an ordinary `Prefill` of the prompt's tokens `[0, n)`, `n` the first
             placeholder of the first piece not yet arrived (the first step, the text
             before the first item, starts at once), with one sampled token; steps run one
             after the other, each as soon as the one before is done and it adds a full
             block to what the worker caches, none once every piece is in. Its full blocks
             enter the worker's prefix cache and the next step reuses them, so it carries
             only the embeddings of items (partitions) reaching past those blocks. Its KV
             lease is released at once (its blocks stay cached, unpinned).
    final    once every piece is in, the job's own prefill (the caller's) reuses the last
             step's blocks; it carries the embeddings of the pieces reaching past them, a
             video's partitions each as its span (`ItemEmbedding.partition_start`, the
             prefill worker takes the video as its pieces: `prefill_worker.partitions`),
             and none of the pieces inside them.

Pieces the route's prefill worker already caches (a video's leading partitions inside its
known cached prefix, `router.pieces.pieces_past`) are neither encoded nor stepped.

So a long video's TTFT approaches max(encode, prefill) plus one piece's prefill, instead of
their sum. Exactness: a step's blocks hash and compute as inside the whole prompt
(`router.pieces`); the worker checks the hashes as always.

Best effort: a step that fails (a full pool, blocks evicted meanwhile, an embedding lost)
is logged and stepping stops; the final prefill computes what is missing, and if it finds an
item it needs without embeddings (FAILED_PRECONDITION) the caller encodes every item and
prefills again. A step whose worker is gone (UNAVAILABLE) fails the job's prefill at once,
so the caller fails over without waiting for the rest of the video to be encoded. A piece
that fails fails the job's encoding as `EncodeStage.encode` does; outputs lost with their
encoder are encoded again without overlap (`Orchestrator`), read as soon as each is in.

Leases: NIXL-held pieces are read by steps without being released (a step names no
`embedding_holders`); the final prefill gets those of the embeddings it carries, the others
are released here, as is everything on failure or cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from common.sampling import SamplingParams
from common.server.peers import PeerClient
from common.wire.sampling import sampling_to_proto
from epd.v1 import multimodal_pb2, prefill_service_pb2
from router.calls import Job, RouterError, suspect_if_failed, worker_failed
from router.encode import NOTHING, Encoded, EncodeStage
from router.pieces import Piece, batched, cached_tokens, pieces_past, step_layout
from router.registry import Registry
from router.routing import PrefillRoute
from router.workers import WorkerRecord

logger = logging.getLogger(__name__)

ONE_TOKEN = sampling_to_proto(SamplingParams(max_tokens=1))
DEPTH = 2  # Encode calls of one job in flight: one encoding, the next queued behind it


class OverlappedPrefill:
    """Encodes a job's items piece by piece while its prefill worker takes each piece as
    it arrives (see the module docstring)."""

    def __init__(self, registry: Registry, channels: PeerClient, encoder: EncodeStage) -> None:
        self.registry = registry  # counts each step on the worker's load
        self.channels = channels  # the prefill worker's channel; lease releases
        self.encoder = encoder  # the job's Encode calls

    async def encode(self, job: Job, route: PrefillRoute, to_encode: Sequence[int]) -> Encoded:
        """The embeddings the job's own prefill on `route.worker` needs once the pieces
        of the items at `to_encode` are encoded and stepped in. Raises RouterError as
        `EncodeStage.encode` does (nothing left leased then)."""
        worker = route.worker
        if not to_encode:
            return NOTHING
        if worker is None or worker.layout is None:
            return await self.encoder.encode(job, to_encode)
        pieces = batched(pieces_past(job.prompt.params.items, to_encode, cached_tokens(route)))
        limit = asyncio.Semaphore(DEPTH)

        async def encode_piece(piece: Piece) -> Encoded:
            async with limit:
                return await self.encoder.encode_partitions(job, piece.item, piece.partitions)

        tasks = [asyncio.ensure_future(encode_piece(p)) for p in pieces]
        try:
            cached = await self._steps(job, worker, pieces, tasks, route.cached_blocks)
            results = list(await asyncio.gather(*tasks))
            return await self._final(job, pieces, results, cached * worker.layout.block_size)
        except BaseException:
            for task in tasks:  # free what any piece got, now or when it finishes
                task.cancel()
                task.add_done_callback(self._release_result)
            raise

    async def _steps(
        self,
        job: Job,
        worker: WorkerRecord,
        pieces: Sequence[Piece],
        tasks: Sequence[asyncio.Future[Encoded]],
        cached: int,
    ) -> int:
        """Run the steps as pieces arrive; the blocks the worker caches after the last
        successful one (`cached`, the route's, when none succeeded). A step goes as far as
        the pieces in by the time it starts (those that arrived while the one before ran
        are taken together); none runs once every piece is in (the job's prefill is next)."""
        assert worker.layout is not None
        block = worker.layout.block_size
        arrived: dict[Piece, multimodal_pb2.ItemEmbedding] = {}
        k = 0  # pieces[:k] are in `arrived`
        while True:
            while k < len(pieces) and tasks[k].done():
                (arrived[pieces[k]],) = tasks[k].result().embeddings
                k += 1
            if k == len(pieces):
                return cached
            n = pieces[k].start
            if n // block <= cached:  # adds no full block to what the worker holds
                await asyncio.wait([tasks[k]])
                continue
            if not await self._step(job, worker, k, n, arrived, cached * block):
                return cached
            cached = n // block

    async def _step(
        self,
        job: Job,
        worker: WorkerRecord,
        k: int,
        n: int,
        arrived: dict[Piece, multimodal_pb2.ItemEmbedding],
        reused: int,
    ) -> bool:
        """Prefill step `k` over tokens `[0, n)` on `worker`; whether it succeeded."""
        request = prefill_service_pb2.PrefillRequest(
            request_id=f"{job.request_id}:step{k}",
            prompt_token_ids=job.prompt.prompt_token_ids[:n],
            multimodal=step_layout(job.prompt.params, n, arrived, reused),
            sampling=ONE_TOKEN,
        )
        if job.cache_salt is not None:
            request.cache_salt = job.cache_salt
        try:
            with self.registry.using(worker):
                timeout = job.time_left("prefill step")
                response = await self.channels.prefill(worker.address, request, timeout)
        except (grpc.aio.AioRpcError, RouterError) as exc:
            if isinstance(exc, grpc.aio.AioRpcError) and worker_failed(exc):
                # The worker is gone: fail over now (the caller cancels the pieces and
                # encodes again for another), not after the video's last piece is encoded.
                suspect_if_failed(self.registry, worker, exc, self.channels.get(worker.address))
                raise self.encoder.calls.error("prefill", worker, exc) from None
            logger.info(
                "request %s: prefill step %d on %s failed, no more steps (%s)",
                job.request_id,
                k,
                worker.shown,
                exc,
            )
            return False
        self.channels.release_kv(response.kv.holder_address or worker.address, response.kv.lease_id)
        logger.debug(
            "request %s: step %d prefilled %d tokens (%d cached)",
            job.request_id,
            k,
            n,
            response.cached_tokens,
        )
        return True

    async def _final(
        self, job: Job, pieces: Sequence[Piece], results: Sequence[Encoded], cached: int
    ) -> Encoded:
        """What the job's own prefill carries: the embeddings of the pieces reaching past
        the first `cached` tokens (the steps' blocks: all before the last piece, so the
        job's prefill reuses them all), a video's partitions each as its own span
        (`ItemEmbedding.partition_start`); every other piece's lease released."""
        out: list[multimodal_pb2.ItemEmbedding] = []
        for piece, result in zip(pieces, results, strict=True):
            if piece.end > cached:  # else inside the steps' blocks: not needed
                out.extend(result.embeddings)
        used = {
            ref.handle.lease_id
            for emb in out
            for ref in (emb.rows, *emb.deepstack)
            if ref.WhichOneof("data") == "handle"
        }
        leases = {lease: addr for r in results for lease, addr in r.leases.items()}
        self.channels.release_embeddings({k: v for k, v in leases.items() if k not in used})
        carried = {k: v for k, v in leases.items() if k in used}
        try:
            self.encoder.check_inline(out)
        except RouterError:
            self.channels.release_embeddings(carried)
            raise
        return Encoded(out, carried)

    def _release_result(self, task: asyncio.Future[Encoded]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.channels.release_embeddings(task.result().leases)
