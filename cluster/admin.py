"""`epd scale`, `epd status`, `epd drain`, `epd undrain`: AdminService calls to a running
router, with their console output. They need an admin key (`--api-key`, $EPD_API_KEY, or the
admin_key file `epd serve` wrote).

Counting workers, the same way in `scale` and `status` (`role_counts`): a worker is serving
when it is registered and not draining; draining ones (after `epd drain`, or retiring after
a scale-down) are counted apart until they leave the registry or are undrained. A scale is
done when the pool's serving count is what was asked and no worker drains that did not
before it (the retired ones are gone; dead ones, held out, leave on their own).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.console import complain
from cluster.console import say as _say

if TYPE_CHECKING:
    from common.server.credentials import ChannelCredentials

logger = logging.getLogger(__name__)


def _routers(args: argparse.Namespace) -> list[str]:
    """The routers `--address` ($EPD_ROUTER) lists, comma-separated; SettingsError when
    none (an empty $EPD_ROUTER, a stray comma: `drain` told no router and said nothing) or
    a port is not 1-65535 (gRPC dialed 99999 as 34463, an empty one as 443)."""
    from common.settings.schema import SettingsError
    from epd.routers import check_port

    # Named as the user gave it: `--address` has $EPD_ROUTER as its default.
    flag = "$EPD_ROUTER" if args.address == os.environ.get("EPD_ROUTER") else "--address"
    routers = [a.strip() for a in args.address.split(",") if a.strip()]
    if not routers:
        raise SettingsError(f"{flag}: no router address given in {args.address!r}")
    for router in routers:
        try:
            check_port(router)
        except ValueError as exc:
            raise SettingsError(f"{flag}: {exc}") from None
    return routers


async def admin_stub(args: argparse.Namespace, router: str | None = None) -> Any:
    """(channel, AdminService stub) to `router`, by default the first one listed."""

    from common.server.credentials import ChannelCredentials, checked_key, read_ca
    from common.server.rpc import channel
    from common.settings.api_keys import ADMIN_KEY_FILE, default_api_key
    from epd.v1 import admin_service_pb2_grpc

    ca = getattr(args, "tls_ca_file", None)
    given = getattr(args, "api_key", None)
    credentials = ChannelCredentials(
        checked_key(given, "--api-key") if given else default_api_key(ADMIN_KEY_FILE),
        root_certificates=read_ca(ca, "--tls-ca-file") if ca else None,
        tls=ca is not None,
    )
    ch = channel(router or _routers(args)[0], credentials=credentials)
    return ch, admin_service_pb2_grpc.AdminServiceStub(ch)


# What `epd scale` says when workers an operator drained keep a pool short.
DRAINED_STAY = (
    "a worker drained with `epd drain` stays in its pool, serving nothing: `epd undrain` it"
)


@dataclass(slots=True)
class RoleCount:
    """Registered workers of one role, as `scale` and `status` count them (module docstring)."""

    serving: int = 0  # registered, not draining: they get new work
    draining: int = 0  # registered, draining: no new work, leaving or drained by an operator
    drained: int = 0  # of those, drained by an operator (`epd drain`): they stay in the pool


def workers_by_role(reply: Any) -> Iterator[tuple[str, Any]]:
    """(role name, `WorkerStatus`) of each worker of an `AdminService.Status` reply, but
    those of a role this CLI does not know."""
    from common.wire.roles import role_from_proto

    for worker in reply.workers:
        try:
            yield role_from_proto(worker.info.role), worker
        except ValueError:
            continue


def role_counts(reply: Any) -> dict[str, RoleCount]:
    """`RoleCount` per worker role name of an `AdminService.Status` reply."""
    from common.roles import WORKER_ROLES

    counts = {str(r): RoleCount() for r in WORKER_ROLES}
    for role, worker in workers_by_role(reply):
        count = counts[role]
        if worker.draining:
            count.draining += 1
            count.drained += worker.drained
        else:
            count.serving += 1
    return counts


async def registered_counts(stub: Any) -> dict[str, int]:
    """Serving workers per role name, from `AdminService.Status` through `stub`."""
    from epd.v1 import admin_service_pb2

    reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
    return {role: count.serving for role, count in role_counts(reply).items()}


def n_workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def counted(count: RoleCount) -> str:
    """ "2 workers serving" or "2 workers serving, 1 draining"."""
    text = f"{n_workers(count.serving)} serving"
    return f"{text}, {count.draining} draining" if count.draining else text


async def cmd_status(args: argparse.Namespace) -> int:
    """One line per worker: role, name, address, load, KV blocks, cache hits, heartbeat."""
    from common.wire.roles import role_from_proto
    from epd.v1 import admin_service_pb2

    ch, stub = await admin_stub(args)
    async with ch:
        reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
    model = reply.model or "-"
    # queued: requests waiting in the router for KV blocks (admission control).
    _say(
        f"router {_routers(args)[0]}  model {model}  requests in flight {reply.active_requests}  "
        f"queued {reply.queued_requests} (peak {reply.queued_peak}, refused "
        f"{reply.refused_requests})"
    )
    # LOAD: requests the worker reports in flight; ROUTED: requests this router has on it;
    # CACHE HITS: prefix (or encoder) cache hits / lookups since the worker started.
    header = ("ROLE", "NAME", "ADDRESS", "LOAD", "ROUTED", "KV USED/FREE", "CACHE HITS")
    rows = [(*header, "SEEN", "STATE")]
    for w in reply.workers:
        load = w.load
        if w.info.role == 1:
            kv = "-"  # the encoder holds no KV
        elif load.kv_blocks_used + load.kv_blocks_free == 0:
            kv = "?"  # no heartbeat yet: its pool is not known
        else:
            kv = f"{load.kv_blocks_used}/{load.kv_blocks_free}"
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
                "draining" if w.draining else "suspect" if w.suspect else "serving",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if not reply.workers:
        _say("(no workers registered)")
    # The counts `epd scale` waits on: serving workers, draining ones apart.
    _say("; ".join(f"{role} {counted(count)}" for role, count in role_counts(reply).items()))
    for line in reply.waiting:  # started by the deployment, not placed by its cluster yet
        _say(f"waiting: {line}")
    for line in reply.failed_starts:  # started by the deployment, out of its pool since
        _say(f"failed: {line}")
    for line in reply.dropped_workers:  # not in the table: silent past the timeout
        _say(f"dropped: {line}")
    for line in reply.refused_registrations:  # not in the table: the router refused them
        _say(f"refused: {line}")
    return 0


def _is_address(worker: str) -> bool:
    """HOST:PORT, as opposed to a worker's name."""
    host, _, port = worker.rpartition(":")
    return bool(host) and port.isdigit()


async def _on_every_router(args: argparse.Namespace, act: Any, away: Any = None) -> int:
    """`await act(stub, address, label)` for the worker `args.worker` (its address, or every
    address registered under that name) on every router listed: each router keeps its own
    registry; `await away(stub, name, label)` where no worker of that name is registered
    (True when the router still knew it). 0 when every router knew the worker, else 1; a
    router that cannot be told is reported, and the others are told all the same.
    SettingsError naming WORKER when it is empty or blank: a name "" would match every
    worker registered without one."""
    import grpc

    from common.settings.schema import SettingsError

    if not args.worker.strip():
        raise SettingsError(
            f"WORKER: {args.worker!r} is empty; give a worker's NAME or HOST:PORT (`epd status`)"
        )
    routers = _routers(args)
    if len(routers) == 1:  # its failure is the command's (`epd: drain failed: ...`)
        return await _on_router(args, act, away, routers[0], "")
    missing = 0
    for router in routers:
        try:
            missing += await _on_router(args, act, away, router, f"{router}: ")
        except grpc.aio.AioRpcError as exc:
            _say(f"{router}: not told: {exc.code().name}: {exc.details()}")
            missing += 1
    return 1 if missing else 0


async def _on_router(args: argparse.Namespace, act: Any, away: Any, router: str, where: str) -> int:
    """`_on_every_router` on one router: 1 when it does not know the worker."""
    from epd.v1 import admin_service_pb2

    ch, stub = await admin_stub(args, router)
    async with ch:
        if _is_address(args.worker):
            found = await act(stub, args.worker, f"{where}{args.worker}")
        else:
            reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
            # Never a worker registered without a name: its name "" is no worker's NAME.
            of_name = [w for w in reply.workers if w.info.name and w.info.name == args.worker]
            named = sorted({w.info.address for w in of_name})
            for address in named:
                await act(stub, address, f"{where}{args.worker} ({address})")
            found = bool(named)
            if not found and away is not None:
                found = await away(stub, args.worker, f"{where}{args.worker}")
    if not found:
        kind = "at" if _is_address(args.worker) else "named"
        complain(f"{where}no registered worker {kind} {args.worker}")
        return 1
    return 0


async def cmd_drain(args: argparse.Namespace) -> int:
    """AdminService.Drain on every router: they stop sending new work to the worker; said
    where it was the last of its role serving."""
    import grpc

    from common.wire.roles import role_from_proto
    from epd.v1 import admin_service_pb2

    async def drain(stub: Any, address: str, label: str) -> bool:
        reply = await stub.Drain(admin_service_pb2.DrainRequest(address=address), timeout=10)
        if reply.found:
            _say(f"{label}: draining (no new work; in-flight work finishes)")
            try:  # the drain is done: a failed look afterwards fails nothing (ownfixB F6)
                status = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                complain(
                    f"{label}: whether it was its role's last serving worker: {exc.code().name}"
                )
                return True
            roles = {w.info.role for w in status.workers if w.info.address == address}
            left = [w for w in status.workers if w.info.role in roles and not w.draining]
            name = role_from_proto(next(iter(roles))) if roles else ""
            if roles and not left:  # said nowhere before (operator2 review M1, s44)
                complain(
                    f"{label}: it was the last serving {name} worker: until one serves "
                    f"(`epd undrain`), requests that need one wait for it or fail, and the "
                    "router's health (readiness) says NOT_SERVING"
                )
            elif roles and all(w.suspect for w in left):  # dead, maybe (s44diff, s45)
                complain(
                    f"{label}: every other {name} worker is suspect (a call on it failed): "
                    "if they are gone, requests that need one fail until one serves"
                )
        return bool(reply.found)

    return await _on_every_router(args, drain)


async def cmd_undrain(args: argparse.Namespace) -> int:
    """AdminService.Undrain on every router: they route new work to a drained worker again.
    1 where the worker itself drains (retiring or stopping)."""
    from epd.v1 import admin_service_pb2

    still = 0

    async def told(reply: Any, label: str) -> bool:
        nonlocal still
        if reply.found and not reply.serving:
            _say(f"{label}: still draining: the worker itself drains (retiring or stopping)")
            still += 1
        elif reply.found:
            _say(f"{label}: serving (gets new work again)")
        elif reply.lifted_away:
            _say(f"{label}: not registered now; it gets new work when it registers again")
        return bool(reply.found or reply.lifted_away)

    async def undrain(stub: Any, address: str, label: str) -> bool:
        request = admin_service_pb2.UndrainRequest(address=address)
        return await told(await stub.Undrain(request, timeout=10), label)

    async def undrain_away(stub: Any, name: str, label: str) -> bool:
        request = admin_service_pb2.UndrainRequest(name=name)
        return await told(await stub.Undrain(request, timeout=10), label)

    rc = await _on_every_router(args, undrain, undrain_away)
    return 1 if still else rc


async def drain_at_router(
    router_address: str,
    worker_address: str,
    timeout_s: float,
    credentials: ChannelCredentials | None = None,
) -> None:
    """Tell the router to stop routing to a worker, then wait for its requests there to end
    (AdminService calls: `credentials` are an admin's or the cluster's).

    Waiting on the router's count (not only the worker's) matters for prefill workers: a
    request still needs the prefill worker after its Prefill RPC returned, until decode has
    pulled the KV blocks.
    """
    from common.server.credentials import NO_CREDENTIALS
    from common.server.rpc import channel
    from epd.v1 import admin_service_pb2, admin_service_pb2_grpc

    deadline = time.monotonic() + timeout_s
    async with channel(router_address, credentials=credentials or NO_CREDENTIALS) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        await stub.Drain(admin_service_pb2.DrainRequest(address=worker_address), timeout=10)
        while time.monotonic() < deadline:
            reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
            busy = [w.router_in_flight for w in reply.workers if w.info.address == worker_address]
            if not busy or busy[0] == 0:
                return
            await asyncio.sleep(0.1)
    logger.warning("router still has requests on %s after %.0fs", worker_address, timeout_s)
