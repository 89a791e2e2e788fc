"""Start the router's HTTP API (`router.http`) beside its gRPC server."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.server.auth import Need
from router.http.app import build_app
from router.http.body import identify
from router.http.connections import ConnectionStats, bounded_protocol
from router.http.media import MediaPolicy
from router.http.server import HttpServer
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
        max_request_bytes=settings.max_message_mb << 20,  # what a gRPC request could carry
    )
    model_id = settings.served_model_name or path.name
    app = build_app(running.servicer, model_id, policy, running.registry.unready, running.auth)
    metrics = running.servicer.orchestrator.metrics

    # The router's Prometheus metrics, at /metrics on the API port too (as vLLM serves them),
    # for an admin key: the API port faces clients, and the page shows every tenant's
    # traffic (`metrics_port` serves it without a key, on `metrics_host`).
    @app.get("/metrics")
    async def metrics_page(request: Request) -> Response:
        identify(running.auth, request.headers.get("authorization"), Need.ADMIN)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    connections = ConnectionStats()
    metrics.watch(running.servicer, connections)
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
        draining=lambda: running.lifecycle.draining,
    )
    await http.start()
    running.lifecycle.on_drain.append(http.close_after_answers)
    running.cleanup.insert(0, http.stop)
    running.http_address = http.address
    logger.info("HTTP API (OpenAI-compatible) on http://%s serving %s", http.address, model_id)
