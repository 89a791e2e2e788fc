"""Start the router's HTTP API (`router.http`) beside its gRPC server."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.routing import Route

from common.server.metrics import asgi_app
from router.http.app import HttpServer, build_app
from router.http.connections import ConnectionStats, bounded_protocol
from router.http.media import MediaPolicy
from router.settings import RouterSettings

if TYPE_CHECKING:
    from router.server import RunningRouter

logger = logging.getLogger(__name__)


async def start_http(running: RunningRouter, settings: RouterSettings, path: Path) -> None:
    """Serve the OpenAI-compatible HTTP API on `http_port` (not -1) for the started router
    `running` (of checkpoint `path`); it stops first among the cleanup steps. Its bounds
    (`router.held`, `router.http.connections`) are in the router's metrics."""
    policy = MediaPolicy(
        media_dir=Path(settings.http_media_dir) if settings.http_media_dir else None,
        fetch_urls=settings.http_fetch_urls,
        fetch_timeout_s=settings.http_fetch_timeout_s,
        max_bytes=settings.http_fetch_max_bytes,
    )
    model_id = settings.served_model_name or path.name
    app = build_app(running.servicer, model_id, policy, running.registry.ready, running.auth)
    metrics = running.servicer.orchestrator.metrics
    # The router's Prometheus metrics, at /metrics on the API port too (as vLLM serves them):
    # the route answers /metrics itself (a mount alone answers it with a 307 to /metrics/,
    # an empty page for a client that does not follow redirects, such as curl).
    page = asgi_app(metrics.registry)
    app.router.routes.append(Route("/metrics", _AsgiEndpoint(page), methods=["GET"]))
    app.mount("/metrics", page)
    connections = ConnectionStats()
    metrics.watch(running.servicer.held, connections)
    http = HttpServer(
        app,
        settings.http_host,
        settings.http_port,
        settings.max_message_mb << 20,
        settings.request_timeout_s,
        running.servicer.held,
        bounded_protocol(
            settings.http_header_timeout_s, settings.http_max_connections, connections
        ),
        connections,
    )
    await http.start()
    running.cleanup.insert(0, http.stop)
    running.http_address = http.address
    logger.info("HTTP API (OpenAI-compatible) on http://%s serving %s", http.address, model_id)


class _AsgiEndpoint:
    """An ASGI app as a route's endpoint (Starlette calls an endpoint that is not a function
    as an ASGI app, and a function as a request handler)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
