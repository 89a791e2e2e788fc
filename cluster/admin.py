"""`epd scale`, `epd status`, `epd drain`: AdminService calls to a running router, with their
console output. They need an admin key (`--api-key`, $EPD_API_KEY, or the admin_key file
`epd serve` wrote)."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from cluster.console import say as _say


async def _admin(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from common.server.credentials import ChannelCredentials
    from common.server.rpc import channel
    from common.settings.api_keys import ADMIN_KEY_FILE, default_api_key
    from epd.v1 import admin_service_pb2_grpc

    ca = getattr(args, "tls_ca_file", None)
    credentials = ChannelCredentials(
        getattr(args, "api_key", None) or default_api_key(ADMIN_KEY_FILE),
        root_certificates=Path(ca).read_bytes() if ca else None,
        tls=ca is not None,
    )
    first = args.address.split(",")[0].strip()  # $EPD_ROUTER may list several routers
    ch = channel(first, credentials=credentials)
    return ch, admin_service_pb2_grpc.AdminServiceStub(ch)


async def registered_counts(stub: Any, *, include_draining: bool = False) -> dict[str, int]:
    """Registered workers per role name, from `AdminService.Status` through `stub`.

    Draining workers are left out unless `include_draining` (a retiring worker still counts
    until it has left the registry).
    """
    from common.roles import WORKER_ROLES
    from common.wire.roles import role_from_proto
    from epd.v1 import admin_service_pb2

    reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
    counts = dict.fromkeys((str(r) for r in WORKER_ROLES), 0)
    for worker in reply.workers:
        try:
            role = role_from_proto(worker.info.role)
        except ValueError:
            continue  # a role this CLI does not know
        if include_draining or not worker.draining:
            counts[role] += 1
    return counts


async def cmd_scale(args: argparse.Namespace) -> int:
    """Ask the router's scaler for `--replicas` workers, then wait until the pool has them."""
    from common.wire.roles import role_to_proto
    from epd.v1 import admin_service_pb2

    ch, stub = await _admin(args)
    async with ch:
        before = (await registered_counts(stub)).get(args.role, 0)
        reply = await stub.Scale(
            admin_service_pb2.ScaleRequest(role=role_to_proto(args.role), replicas=args.replicas),
            timeout=60,
        )
        _say(f"{args.role}: {_workers(before)} -> {_workers(reply.replicas)}")
        if args.no_wait:
            return 0
        t0 = time.monotonic()
        while True:
            counts = await registered_counts(stub, include_draining=True)
            if counts.get(args.role, 0) == reply.replicas:
                took = time.monotonic() - t0
                _say(f"{args.role}: {_workers(reply.replicas)} registered ({took:.1f}s)")
                return 0
            if time.monotonic() - t0 > args.timeout:
                _say(f"{args.role}: still {counts.get(args.role, 0)} after {args.timeout:.0f}s")
                return 1
            await asyncio.sleep(0.2)


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


async def cmd_status(args: argparse.Namespace) -> int:
    """One line per worker: role, name, address, load, KV blocks, cache hits, heartbeat."""
    from common.wire.roles import role_from_proto
    from epd.v1 import admin_service_pb2

    ch, stub = await _admin(args)
    async with ch:
        reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
    model = reply.model or "-"
    # queued: requests waiting in the router for KV blocks (admission control).
    _say(
        f"router {args.address}  model {model}  requests in flight {reply.active_requests}  "
        f"queued {reply.queued_requests} (peak {reply.queued_peak}, refused "
        f"{reply.refused_requests})"
    )
    # LOAD: requests the worker reports in flight; ROUTED: requests this router has on it;
    # CACHE HITS: prefix (or encoder) cache hits / lookups since the worker started.
    header = ("ROLE", "NAME", "ADDRESS", "LOAD", "ROUTED", "KV USED/FREE", "CACHE HITS")
    rows = [(*header, "SEEN", "STATE")]
    for w in reply.workers:
        load = w.load
        kv = "-" if w.info.role == 1 else f"{load.kv_blocks_used}/{load.kv_blocks_free}"
        hits = f"{load.cache_hits}/{load.cache_lookups}"
        rows.append(
            (
                str(role_from_proto(w.info.role)),
                w.info.name or "-",
                w.info.address,
                str(load.active_requests),
                str(w.router_in_flight),
                kv,
                hits,
                f"{w.seconds_since_heartbeat:.1f}s ago",
                "draining" if w.draining else "serving",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if not reply.workers:
        _say("(no workers registered)")
    return 0


async def cmd_drain(args: argparse.Namespace) -> int:
    """AdminService.Drain: the router stops sending new work to the worker."""
    from epd.v1 import admin_service_pb2

    ch, stub = await _admin(args)
    async with ch:
        reply = await stub.Drain(admin_service_pb2.DrainRequest(address=args.worker), timeout=10)
    if not reply.found:
        _say(f"no registered worker at {args.worker}")
        return 1
    _say(f"{args.worker}: draining (no new work; in-flight work finishes)")
    return 0
