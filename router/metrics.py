"""The router's Prometheus metrics (docs/metrics.md lists them all).

`RouterMetrics` owns the router's registry (served by `RoleServer` on `metrics_port`, and
mounted at `/metrics` by the HTTP front door). Latencies are observed by `track`, which
wraps the chunk stream of one request, so every front door (gRPC Generate, the HTTP API)
measures the same way; planning time, re-prefills and skipped items are observed where they
happen (`router.orchestrator`); admission, retries and the request gauges are read from the
counters `Admission` and `WorkerCalls` keep, at scrape time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.byte_lru import ByteBudgetLru
from common.roles import Role
from common.server.metrics import ScrapeCollector, counter, gauge, requests_metrics
from epd.v1 import router_service_pb2
from router.admission import Admission
from router.calls import WorkerCalls
from router.embedding_cache import EmbeddingCache
from router.outcomes import OUTCOMES

if TYPE_CHECKING:  # uvicorn is imported only when the HTTP API is served
    from router.held import HeldBytes
    from router.http.connections import ConnectionStats
    from router.prepare_threads import PrepareThreads
    from router.returns import Returns


class FrontDoor(Protocol):
    """What `RouterMetrics.watch` reads of the router's servicer."""

    held: HeldBytes
    prepare_threads: PrepareThreads
    returns: Returns


# vLLM's buckets, so dashboards built for vLLM read these too.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
TTFT_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
# Below vLLM's lowest too (only `le` values added): a small model's gaps and whole answers
# all fell in the first bucket, and every quantile read as that bucket's bound.
ITL_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
]
ITL_BUCKETS += [5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [
    0.025,
    0.05,
    0.1,
    0.2,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
]
E2E_BUCKETS += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
PLANNING_BUCKETS = [1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.1]

Chunk = router_service_pb2.GenerateResponse


class RouterMetrics:
    """The router's instruments and its registry (module docstring)."""

    def __init__(
        self,
        admission: Admission,
        calls: WorkerCalls,
        embeddings: EmbeddingCache | None = None,
        images: ByteBudgetLru[Any] | None = None,
    ) -> None:
        self.registry = registry = CollectorRegistry()
        self._admission = admission
        self._calls = calls
        self._embeddings = embeddings  # the encode stage's kept outputs (None: off)
        self._images = images  # the processor's processed images (None: off)
        self.in_flight = 0  # requests inside `request`: from arrival (processing) to the end
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from the request's arrival to its first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens (a chunk of n tokens: n observations of gap / n).",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.finished = Counter(
            "epd:requests_finished",
            "Requests ended, by outcome: stop, length, cancelled, deadline, invalid, refused, "
            "unavailable, error (router.outcomes).",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.finished.labels(outcome)  # every series from the start, at 0
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token, of requests that finished.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.planning = Histogram(
            "epd:router_planning_seconds",
            "Router planning overhead per request: step=hash (block hashes), step=route "
            "(prefill choice and the items its cached prefix covers).",
            ["step"],
            buckets=PLANNING_BUCKETS,
            registry=registry,
        )
        self.reprefills = Counter(
            "epd:reprefills",
            "Prefills run again because decode refused the KV (ABORTED), or its lease's TTL "
            "passed before it was sent.",
            registry=registry,
        )
        self.migrations = Counter(
            "epd:decode_migrations",
            "Decode streams resumed on another decode worker after theirs failed mid-stream.",
            registry=registry,
        )
        self.tokens_recomputed = Counter(
            "epd:decode_tokens_recomputed",
            "Tokens already streamed whose KV a resuming decode worker computed again.",
            registry=registry,
        )
        self.items_skipped = Counter(
            "epd:items_skipped",
            "Multimodal items not encoded: they lie wholly in the prefill worker's cached prefix.",
            registry=registry,
        )
        self.partitions_skipped = Counter(
            "epd:partitions_skipped",
            "Leading partitions of partition-keyed items not encoded: their runs lie wholly in "
            "the prefill worker's cached prefix (the rest of the item is).",
            registry=registry,
        )
        registry.register(ScrapeCollector(self._scrape))

    def _scrape(self) -> list[Any]:
        admission = self._admission
        waiting = admission.stats().queued
        refused = CounterMetricFamily(
            "epd:admission_refused",
            "Requests refused by admission, by reason (queue_full, queue_wait, never_fits).",
            labels=["reason"],
        )
        for reason in ("queue_full", "queue_wait", "never_fits"):
            refused.add_metric([reason], admission.refused[reason])
        retries = CounterMetricFamily(
            "epd:retries",
            "Stage calls tried again after UNAVAILABLE (on another worker, or one back from a "
            "restart), by stage.",
            labels=["stage"],
        )
        for stage in ("encode", "prefill", "decode"):
            retries.add_metric([stage], self._calls.retries[stage])
        suspect = GaugeMetricFamily(
            "epd:workers_suspect",
            "Registered workers picked last, by role: a call on them failed UNAVAILABLE and no "
            "heartbeat has cleared the mark since.",
            labels=["role"],
        )
        workers = GaugeMetricFamily(
            "epd:workers",
            "Registered live workers, by role and state: serving, suspect (picked last) or "
            "draining (no new work).",
            labels=["role", "state"],
        )
        for role in Role:
            records = self._calls.registry.workers(role)
            suspect.add_metric([str(role)], sum(w.suspect for w in records))
            draining = sum(w.draining for w in records)
            flagged = sum(w.suspect and not w.draining for w in records)
            workers.add_metric([str(role), "serving"], len(records) - draining - flagged)
            workers.add_metric([str(role), "suspect"], flagged)
            workers.add_metric([str(role), "draining"], draining)
        return [
            *requests_metrics(max(self.in_flight - waiting, 0), waiting),
            counter("epd:admission_admitted", "Requests admitted.", admission.admitted),
            refused,
            counter(
                "epd:admission_requeued",
                "Requests queued again after a prefill worker's RESOURCE_EXHAUSTED.",
                admission.requeued,
            ),
            counter(
                "epd:admission_placed_ahead",
                "Requests placed before an earlier waiter whose tenant was past its tenant_share "
                "of the KV blocks while other tenants waited.",
                admission.placed_ahead,
            ),
            retries,
            suspect,
            workers,
            counter(
                "epd:embedding_cache_hits",
                "Items sent to prefill with the encoder output the router kept for them "
                "(embedding_cache_mb), without an Encode call.",
                0 if self._embeddings is None else self._embeddings.hits,
            ),
            gauge(  # caches that fill up to their budgets look like a leak unless shown
                "epd:embedding_cache_bytes",
                "Bytes of the encoder outputs the router keeps (up to embedding_cache_mb).",
                0 if self._embeddings is None else self._embeddings.bytes_used,
            ),
            gauge(
                "epd:processed_image_cache_bytes",
                "Bytes of the processed images and video patches the router keeps (up to "
                "processed_image_cache_mb).",
                0 if self._images is None else self._images.bytes_used,
            ),
        ]

    def watch(self, front: FrontDoor, connections: ConnectionStats | None = None) -> None:
        """Serve the front doors' bounds too: the requests `front.held`, its preparation
        threads and restart waits, and the HTTP API's `connections` (None: no HTTP API)."""
        held = front.held

        def scrape() -> list[Any]:
            pending = GaugeMetricFamily(
                "epd:prepare_pending",
                "Requests being prepared (media fetched and decoded, text tokenized) or "
                "queued for a preparation thread, by pool (heavy: media; light: text).",
                labels=["pool"],
            )
            for pool, n in front.prepare_threads.pending.items():
                pending.add_metric([pool], n)
            families = [
                gauge("epd:requests_held_bytes", "Bytes of requests held now.", held.held),
                counter(
                    "epd:requests_refused_held",
                    "Requests refused because holding them would pass requests_in_flight_mb, "
                    "or with no place left to wait to be read.",
                    held.refused,
                ),
                pending,
                counter(
                    "epd:requests_waited_for_worker",
                    "Requests that waited for a role's last worker to come back from a restart.",
                    front.returns.waited,
                ),
            ]
            if connections is not None:
                closed = CounterMetricFamily(
                    "epd:http_connections_closed",
                    "HTTP connections the router closed, by reason (cap, header_timeout, "
                    "body_timeout, unread).",
                    labels=["reason"],
                )
                closed.add_metric(["cap"], connections.closed_at_cap)
                closed.add_metric(["header_timeout"], connections.closed_late)
                closed.add_metric(["body_timeout"], connections.closed_body_late)
                closed.add_metric(["unread"], connections.closed_unread)
                families += [
                    gauge("epd:http_connections", "HTTP connections open now.", connections.open),
                    closed,
                ]
            return families

        self.registry.register(ScrapeCollector(scrape))

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Counts one request in flight (`vllm:num_requests_running`, with the admission
        queue's `waiting` taken off) for as long as it runs, its processing included."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def track(self, stream: AsyncIterator[Chunk], started: float) -> AsyncIterator[Chunk]:
        """Yield `stream`'s chunks, observing TTFT, inter-token latency and (when the stream
        ends normally) end-to-end latency from `started` (time.monotonic() at arrival).
        Closes `stream` (an async generator) when closed early."""
        last: float | None = None
        try:
            async for chunk in stream:
                n = len(chunk.token_ids)
                if n:
                    now = time.monotonic()
                    if last is None:
                        self.ttft.observe(now - started)
                    else:
                        for _ in range(n):
                            self.itl.observe((now - last) / n)
                    last = now
                yield chunk
            self.e2e.observe(time.monotonic() - started)
        finally:
            if isinstance(stream, AsyncGenerator):
                await stream.aclose()
