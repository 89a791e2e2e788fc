"""Prometheus metrics for every epd process: one registry per server, its HTTP endpoint,
and the scrape-time collectors the roles share (docs/metrics.md lists every metric).

Each server object owns its own `CollectorRegistry` (never prometheus_client's global one),
so several servers in one process (tests, `epd serve` on one node) never collide. Counters
the servicers already keep are not mirrored on the hot path: a `ScrapeCollector` reads them
when `/metrics` is scraped. `MetricsEndpoint.start` serves a registry on `host:port` (port
0: a free one) and logs `EPD_METRICS_ADDRESS=host:port`; whoever started it closes it
(`RoleServer.stop` does, after gRPC). The router's HTTP API serves its registry at
`/metrics` for an admin key (`router.http.serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.kv.block_pool import BlockPool
from common.settings.schema import SettingsError

logger = logging.getLogger(__name__)

# No `*_created` sample beside each counter and histogram: nothing here documents or reads
# them, and they double the page's series (process-wide, as prometheus_client sets it).
disable_created_metrics()

Scrape = Callable[[], Iterable[Any]]  # yields prometheus_client Metric families


class ScrapeCollector(Collector):
    """A collector whose metric families `scrape()` makes at each scrape (read-only)."""

    def __init__(self, scrape: Scrape) -> None:
        self._scrape = scrape

    def collect(self) -> Iterator[Any]:
        yield from self._scrape()


def scrape_registry(*scrapes: Scrape) -> CollectorRegistry:
    """A fresh registry holding one `ScrapeCollector` per `scrapes` entry."""
    registry = CollectorRegistry()
    for scrape in scrapes:
        registry.register(ScrapeCollector(scrape))
    return registry


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """A label-less counter family (`name` without `_total`; the exposition adds it)."""
    return CounterMetricFamily(name, doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    """A label-less gauge family."""
    return GaugeMetricFamily(name, doc, value=value)


def requests_metrics(running: int, waiting: int) -> list[Any]:
    """vLLM's request gauges: `running` being served, `waiting` queued before service."""
    return [
        gauge("vllm:num_requests_running", "Requests being served now.", running),
        gauge("vllm:num_requests_waiting", "Requests queued before being served.", waiting),
    ]


def kv_pool_metrics(pool: BlockPool, block_size: int) -> list[Any]:
    """A KV worker's prefix cache (tokens looked up / found, as vLLM counts them, in the
    full blocks only a cache holds: they counted blocks, and vLLM's dashboards read tokens:
    operator2 review L5, s44) and pool usage."""
    queried, hit = pool.lookups * block_size, pool.hits * block_size
    return [
        counter(
            "vllm:prefix_cache_queries",
            "Tokens looked up in the prefix cache (of full KV blocks).",
            queried,
        ),
        counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache.", hit),
        gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use (0 to 1).",
            pool.num_used_blocks / pool.num_blocks,
        ),
    ]


# A `/metrics` endpoint serves at most this many connections at once (one past it is closed
# as it opens), each for at most this long, whatever it sends: the port needs no
# credentials, and 400 silent connections held a worker's 370 threads (metrics review, s33);
# a per-read timeout let a client trickling a byte at a time keep its place (own-fix review).
MAX_SCRAPERS = 32
SCRAPE_S = 10.0


class _Scrapes(ThreadingMixIn, WSGIServer):
    """A thread per connection, `MAX_SCRAPERS` at most; daemon threads (none left to join)."""

    daemon_threads = True

    def __init__(self, family: socket.AddressFamily, address: tuple[str, int]) -> None:
        self.slots = threading.BoundedSemaphore(MAX_SCRAPERS)
        self.address_family = family  # IPv4 or IPv6, as `host` is
        super().__init__(address, _Scrape)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing else gives the slot back
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Scrape(WSGIRequestHandler):
    """One connection: silent (no access log), cut `limit_s` after it opened (a blocked read
    or write then ends as the client's hang-up, which wsgiref passes over quietly)."""

    limit_s = SCRAPE_S

    def setup(self) -> None:
        super().setup()
        self.cut = threading.Timer(self.limit_s, self._cut)
        self.cut.daemon = True
        self.cut.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self.cut.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[WSGIServer, threading.Thread]:
    """`/metrics` of `registry` on `host:port`, from a daemon thread."""
    family, *_ = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server = _Scrapes(family, (host, port))
    server.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="epd-metrics", daemon=True)
    thread.start()
    return server, thread


@dataclass(slots=True, eq=False)
class MetricsEndpoint:
    """A running `/metrics` HTTP server (a daemon thread) for one registry."""

    registry: CollectorRegistry  # what it serves
    address: str  # "host:port" actually bound
    _server: Any  # wsgiref WSGIServer
    _thread: threading.Thread

    @classmethod
    def start(
        cls, registry: CollectorRegistry, host: str, port: int, whose: str = ""
    ) -> MetricsEndpoint:
        """Serve `registry` on `host:port` (0: a free port); SettingsError naming
        `metrics_port` when it cannot listen there (say, two workers given one port).
        `whose` ("prefill epd-prefill-0"): said after the address in the log line, so that
        several workers' free ports can be told apart."""
        try:
            server, thread = _serve(registry, host, port)
        except OSError as exc:
            raise SettingsError(f"metrics_port: cannot listen on {host}:{port}: {exc}") from None
        shown = f"[{host}]" if ":" in host else host
        endpoint = cls(registry, f"{shown}:{server.server_port}", server, thread)
        logger.info("EPD_METRICS_ADDRESS=%s%s", endpoint.address, f" ({whose})" if whose else "")
        return endpoint

    async def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        await asyncio.to_thread(server.shutdown)
        server.server_close()
        await asyncio.to_thread(self._thread.join)  # its serve_forever has returned
