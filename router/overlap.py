"""Encoding overlapped with prefill: while a job's items are encoded, its prefill worker
computes the text before the first item (router setting `overlap_text_prefill`, off by
default).

The text prefill is an ordinary `Prefill` of the prompt's leading tokens `[0, n)`, `n` the
first item's first placeholder, with no multimodal part and one sampled token. Its full
blocks enter the worker's prefix cache, and the job's own prefill, sent once the
embeddings are in, reuses them, so the prompt's leading text is computed while the encoder
works instead of after it. Exact: blocks before the first item carry no extra keys and
their positions are their indexes (mRoPE gives text its running index), so those blocks
hash and compute as they do inside the whole prompt; the job's prefill checks the hashes
as always.

Best effort: it runs only when the route names the worker, at least one full block of that
text is not cached there yet and some item is being encoded; any failure (a full pool, a
worker gone) is logged and ignored, and the job's prefill simply computes the text itself.
The text prefill's KV lease is released at once (its blocks stay cached, unpinned).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.sampling import SamplingParams
from common.server.peers import PeerClient
from common.wire.convert import sampling_to_proto
from epd.v1 import multimodal_pb2, prefill_service_pb2, prefill_service_pb2_grpc
from router.calls import Job, RouterError
from router.registry import Registry
from router.routing import PrefillRoute

logger = logging.getLogger(__name__)

ONE_TOKEN = sampling_to_proto(SamplingParams(max_tokens=1))


class TextPrefill:
    """Prefills the text before a job's first item (see the module docstring)."""

    def __init__(self, registry: Registry, channels: PeerClient) -> None:
        self.registry = registry  # counts the call on the worker's load
        self.channels = channels  # the prefill worker's channel; lease releases
        self.started = 0  # text prefills sent (metrics, tests)

    def leading_tokens(self, job: Job, route: PrefillRoute, encoding: bool) -> int:
        """Tokens of the text prefill for this route: the first item's position when that
        adds a full block to what the worker caches and items are being encoded, else 0."""
        items = job.prompt.params.items
        if route.worker is None or route.worker.layout is None or not items or not encoding:
            return 0
        n = items[0].position
        return n if n // route.worker.layout.block_size > route.cached_blocks else 0

    def start(self, job: Job, route: PrefillRoute, encoding: bool) -> asyncio.Task[None] | None:
        """Start the text prefill on the route's worker, or None when there is none to do.
        The task never raises; await it before the job's own prefill."""
        n = self.leading_tokens(job, route, encoding)
        if n == 0 or route.worker is None:
            return None
        self.started += 1
        return asyncio.ensure_future(self._run(job, route, n))

    async def _run(self, job: Job, route: PrefillRoute, n: int) -> None:
        worker = route.worker
        assert worker is not None
        request = prefill_service_pb2.PrefillRequest(
            request_id=f"{job.request_id}:text",
            prompt_token_ids=job.prompt.prompt_token_ids[:n],
            multimodal=multimodal_pb2.MultimodalParams(),
            sampling=ONE_TOKEN,
        )
        if job.cache_salt is not None:
            request.cache_salt = job.cache_salt
        stub = prefill_service_pb2_grpc.PrefillServiceStub(self.channels.get(worker.address))
        try:
            with self.registry.using(worker):
                response: prefill_service_pb2.PrefillResponse = await stub.Prefill(
                    request, timeout=job.time_left("text prefill")
                )
        except (grpc.aio.AioRpcError, RouterError) as exc:
            logger.info(
                "request %s: no text prefill on %s (%s)", job.request_id, worker.address, exc
            )
            return
        self.channels.release_kv(response.kv.holder_address or worker.address, response.kv.lease_id)
