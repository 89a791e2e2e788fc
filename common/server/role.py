"""The running server of one epd role (router, encoder, prefill, decode), with the one
ordered drain and stop they all share.

A role's `serve(settings)` builds its typed servicer and calls `RoleServer.start`, which
serves it (plus `grpc.health.v1` and any extra servicers) as the settings say and attaches
the lifecycle; then the role starts its background work, `register`s with every router
(workers: ready, health "", only while a router accepts it) and returns the server. The
caller owns it.

Drain (`drain`, or SIGTERM through `run_until_signal`): the lifecycle refuses new work and
the registrations heartbeat `draining` to every router at once (so they stop routing here),
then keep heartbeating while tracked RPCs and the leases held for peers (`leases`) run out,
up to the drain timeout; then the stop below.

Stop, in this order (`stop`, also the end of `drain`), each step once:
  1. the registrations: heartbeats end, so the routers forget this worker;
  2. gRPC: health NOT_SERVING, RPCs still running after the grace period are cancelled;
  3. `tasks`: background loops of the role, cancelled;
  4. the `/metrics` endpoint (`common.server.metrics`), when one was started;
  5. `cleanup`: the role's own steps, in the order the role listed them (e.g. reaper, leases,
     peer client, model thread, NIXL agent), each failure logged, never raised.
`drain(timeout_s)` first refuses new work and lets tracked RPCs finish (`ServerLifecycle`).

Security comes from `settings.security` (`common.server.auth`): every call is checked against
the cluster bearer (and, for the router, `client_api=True`, the API keys); TLS as configured,
client certificates required on service ports when a CA is given. `credentials` is what this
server presents to others (registration, peers).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import uuid
from collections.abc import Awaitable, Callable, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector

from common.models.tiny import default_checkpoint
from common.server.auth import Authenticator, server_tls, service_credentials
from common.server.credentials import NO_CREDENTIALS, ChannelCredentials
from common.server.lifecycle import ServerLifecycle
from common.server.metrics import MetricsEndpoint
from common.server.registrar import Registrations
from common.server.rpc import CLIENT_STREAM_WINDOW, RunningServer, start_server
from common.settings.base import ServerSettings
from epd.v1 import registry_service_pb2

logger = logging.getLogger(__name__)

S = TypeVar("S")
R = TypeVar("R", bound="RoleServer[Any]")
Cleanup = Callable[[], Awaitable[None]]
AddServicer = Callable[[Any], None]  # e.g. `lambda s: add_XServicer_to_server(impl, s)`
READINESS_CHECK_S = 1.0  # how often a worker's readiness looks at its registrations
# A server raises its process's soft limit on open files to the hard one, up to this: the
# connections its ports keep (`grpc_max_connections`, the router's `http_max_connections`)
# and its channels are file descriptors, and a soft limit of 1024 (many systems' default)
# would be reached before those caps.
MAX_OPEN_FILES = 1 << 20


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files (module constant); returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # not allowed here: keep the old one
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    return soft


def freeze_startup_heap() -> None:
    """Put every object alive now (the role's model, tokenizer, settings, ...) out of the
    garbage collector's reach (`gc.freeze`): they live as long as the process, and a full
    collection walking them stalls every request in flight (in the router's planning
    benchmark, hash + route p99 9.6 ms with them, 1.3 ms without). Call once, when serving."""
    gc.collect()
    gc.freeze()


def checkpoint_path(model: str | None) -> Path:
    """The checkpoint folder: `model`, or the built-in tiny one when unset (made on first
    use, so call it off the event loop)."""
    return Path(model) if model else default_checkpoint("tiny")


async def run_steps(steps: Sequence[Cleanup], what: str) -> None:
    """Await each step in order; a failing step is logged and the next one still runs."""
    for step in steps:
        try:
            await step()
        except Exception:
            logger.exception("%s: a step failed", what)


@dataclass(slots=True, eq=False)
class RoleServer(RunningServer, Generic[S]):
    """A role's started gRPC server plus everything that must stop with it (module
    docstring). `servicer` is the role's typed servicer (counters, runner, ...)."""

    servicer: S = field(kw_only=True)  # the role's servicer
    lifecycle: ServerLifecycle = field(kw_only=True)  # serving / draining / stopped
    leases: Sized | None = field(default=None, kw_only=True)  # leases held for peers
    registrar: Registrations | None = field(default=None, kw_only=True)  # set by `register`
    tasks: list[asyncio.Task[None]] = field(default_factory=list, kw_only=True)  # loops
    cleanup: list[Cleanup] = field(default_factory=list, kw_only=True)  # after gRPC stops
    credentials: ChannelCredentials = field(default=NO_CREDENTIALS, kw_only=True)  # presented
    auth: Authenticator | None = field(default=None, kw_only=True)  # None: insecure
    # This server's metrics (its own, never the global registry) and their HTTP endpoint
    # (None: `metrics_port` unset).
    metrics: CollectorRegistry = field(default_factory=CollectorRegistry, kw_only=True)
    metrics_endpoint: MetricsEndpoint | None = field(default=None, kw_only=True)

    @classmethod
    async def start(
        cls: type[R],
        settings: ServerSettings,
        servicer: Any,
        add_servicer: Callable[[Any, Any], None],
        service_names: Sequence[str],
        *,
        lifecycle: ServerLifecycle,
        extra_servicers: Sequence[AddServicer] = (),
        leases: Sized | None = None,
        cleanup: Sequence[Cleanup] = (),
        auth: Authenticator | Literal["settings"] | None = "settings",
        client_api: bool = False,
        metrics: CollectorRegistry | None = None,
    ) -> R:
        """Serve `servicer` via `add_servicer(servicer, server)` (an `add_*_to_server`),
        with `extra_servicers` and health for `service_names`, on `settings.host:port`.

        `auth`: the authenticator ("settings": built from `settings.security`; the router
        passes the one it built, it needs it too; None: no authentication); `client_api`:
        this port serves clients (the router: API keys are read, client certificates are
        not required); `metrics`: the role's registry (None: an empty one), served on
        `settings.metrics_host:metrics_port` when that port is set.
        Returns the server, serving, with `lifecycle` attached. When the server cannot start
        (SettingsError for a missing secret among others), the `cleanup` steps run (freeing
        what the role built for it) and the error propagates.
        """
        security = settings.security
        raise_open_files_limit()
        try:
            settings.check()
            if auth == "settings":
                auth = Authenticator.from_settings(security, api_keys=client_api)
            running = await start_server(
                [lambda s: add_servicer(servicer, s), *extra_servicers],
                host=settings.host,
                port=settings.port,
                service_names=service_names,
                max_message_mb=settings.max_message_mb,
                auth=auth,
                tls=server_tls(security, client_certs=not client_api),
                name=_role_name(service_names),
                stream_window_bytes=CLIENT_STREAM_WINDOW if client_api else None,
                max_connections=settings.grpc_max_connections,
            )
            registry = metrics if metrics is not None else CollectorRegistry()
            ProcessCollector(registry=registry)  # process_cpu_seconds_total, memory, fds
            endpoint = None
            if settings.metrics_port is not None:
                try:
                    whose = f"{_role_name(service_names)} {getattr(settings, 'name', '')}"
                    endpoint = MetricsEndpoint.start(
                        registry, settings.metrics_host, settings.metrics_port, whose.strip()
                    )
                except BaseException:
                    await running.stop(0)
                    raise
        except BaseException:
            await run_steps(cleanup, "cleanup after a failed start")
            raise
        server = cls(
            running.server,
            running.health,
            running.address,
            running.service_names,
            servicer=servicer,
            lifecycle=lifecycle,
            leases=leases,
            cleanup=list(cleanup),
            credentials=service_credentials(security),
            auth=auth,
            metrics=registry,
            metrics_endpoint=endpoint,
        )
        lifecycle.attach(server)
        if leases is not None:
            lifecycle.holds.append(leases.__len__)  # a drain waits for peers' pulls too
        return server

    def register(
        self,
        routers: str | Sequence[str] | None,
        info: registry_service_pb2.WorkerInfo,
        load: Callable[[], registry_service_pb2.WorkerLoad],
        discover: str | None = None,
        **options: float,
    ) -> None:
        """Start registering with every router in `routers` (`WorkerSettings.routers`; one
        address or none also do) and every address `discover` resolves to (`router_dns`);
        `load` is called for every heartbeat. The registration carries a fresh
        `instance_id` (this process start). Readiness follows the registrations from now
        (`_ready_while_accepted`). Draining heartbeats at once; `stop` stops the
        registrations first. `options`: `Registrar`'s timing keywords (tests)."""
        addresses = [routers] if isinstance(routers, str) else list(routers or ())
        if not (addresses or discover) or self.registrar is not None:
            return
        sent = registry_service_pb2.WorkerInfo()
        sent.CopyFrom(info)
        sent.instance_id = sent.instance_id or uuid.uuid4().hex
        self.registrar = Registrations(
            addresses, sent, load, credentials=self.credentials, discover=discover, **options
        )
        self.lifecycle.on_drain.append(self.registrar.heartbeat_now)
        self.registrar.start()
        self.tasks.append(asyncio.create_task(self._ready_while_accepted(self.registrar)))

    async def _ready_while_accepted(self, registrar: Registrations) -> None:
        """Readiness ("" and the service names) follows the registrations: SERVING while
        some router accepts the worker (`Registrations.accepted`: registered it, or answered
        a heartbeat, within the last few heartbeats), NOT_SERVING before the first
        acceptance and once every router has refused it or been unreachable for longer (a
        rotated token, another model or protocol, no router left), SERVING again on the next
        acceptance. So a rolling update keeps the pods it would replace while no router
        takes the new ones. Liveness is not touched; draining ends it (NOT_SERVING)."""
        serving: bool | None = None
        ever = False  # accepted once: "again" from then on
        while not (self.stopped or self.lifecycle.draining):
            registrar.registered.clear()
            accepted = registrar.accepted()
            if accepted != serving:
                if serving is not None:
                    logger.log(
                        logging.INFO if accepted else logging.WARNING,
                        "%s: %s",
                        self.address,
                        f"a router accepts this worker{' again' if ever else ''}: ready"
                        if accepted
                        else "no router has accepted this worker lately: not ready",
                    )
                await self.set_serving(accepted)
                serving = accepted
                ever = ever or accepted
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(READINESS_CHECK_S):
                    await registrar.registered.wait()
        if serving and self.lifecycle.draining:  # drain began while SERVING was being set
            await self.set_serving(False)

    def outstanding_leases(self) -> int:
        """Leases this server still holds for peers (0 when its role holds none)."""
        return len(self.leases) if self.leases is not None else 0

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work, let tracked RPCs finish (up to `timeout_s`), then `stop`.

        True when every tracked RPC finished in time."""
        clean = await self.lifecycle.drain(timeout_s)
        await self.stop(0)
        return clean

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """The ordered stop of the module docstring (idempotent)."""
        if self.stopped:
            return
        self.stopped = True
        if self.registrar is not None:
            await run_steps([self.registrar.stop], "stopping the registrar")
        await self.shutdown(grace_s)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.metrics_endpoint is not None:
            await run_steps([self.metrics_endpoint.close], "stopping the metrics endpoint")
        await run_steps(self.cleanup, "cleanup after the server stopped")


def _role_name(service_names: Sequence[str]) -> str:
    """What error messages call this server: "router" for ("epd.v1.RouterService", ...)."""
    if not service_names:
        return "server"
    return service_names[0].rsplit(".", 1)[-1].removesuffix("Service").lower() or "server"
