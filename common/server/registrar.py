"""Worker-side registration with the routers: Register once with each, then Heartbeat with
load. A worker given several routers (`WorkerSettings.routers`) keeps one `Registrar` per
router in a `Registrations`: each router keeps its own registry, so each registration lives
and fails on its own.

Lifecycle of a `Registrar`: `start()` launches a background task that registers (retrying
with a backoff capped at 1 s while the router is unreachable or refuses), heartbeats its load
at once (the router's admission accounts a worker's KV only from a heartbeat), then every
`heartbeat_interval_ms` the router asked for. A heartbeat answered `known=False`, or one that
fails (router restarted, network), sends the worker back to registering. The task logs
failures — the first of an outage at WARNING, repeats at DEBUG — and never raises. `stop()`
cancels it and closes the channel. The channel presents `credentials` (the cluster bearer:
the router accepts registrations only from services of the deployment). `heartbeat_now()`
sends one heartbeat at once (a worker that starts draining says so before the next tick, so
the router stops routing to it at once; it keeps heartbeating while its in-flight work
finishes, or the router would expire it and drop the channel those streams run on).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from common.server.credentials import NO_CREDENTIALS, ChannelCredentials
from common.server.rpc import channel
from epd.v1 import registry_service_pb2, registry_service_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0
# A router that has not accepted the worker (registered it, or answered a heartbeat as known)
# for this many heartbeat intervals, beyond one RPC deadline, no longer counts as accepting it
# (`Registrar.accepting`): one failed heartbeat, re-registered at once, does not count.
STALE_HEARTBEATS = 3


class Registrar:
    """Keeps one worker registered with the router at `router_address`.

    `load_fn` is called (in the event loop, so keep it cheap) before every heartbeat; if it
    raises, an empty load is sent. Counters `registrations` and `heartbeats` are for tests
    and metrics. `worker_id` is None while not registered; `accepted_at` is when the router
    last accepted the worker (`accepting`).
    """

    def __init__(
        self,
        router_address: str,
        worker_info: registry_service_pb2.WorkerInfo,
        load_fn: Callable[[], registry_service_pb2.WorkerLoad],
        *,
        rpc_timeout_s: float = 5.0,
        retry_initial_s: float = 0.2,
        retry_max_s: float = 1.0,
        credentials: ChannelCredentials = NO_CREDENTIALS,
        on_registered: Callable[[], None] | None = None,
    ) -> None:
        self.router_address = router_address
        self.on_registered = on_registered  # called after each successful Register
        self.credentials = credentials  # presented on every call to the router
        self.worker_info = worker_info
        self.load_fn = load_fn
        self.rpc_timeout_s = rpc_timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.worker_id: str | None = None  # from the last successful Register
        self.heartbeat_s = DEFAULT_HEARTBEAT_S  # from the last RegisterResponse
        self.registrations = 0  # successful Register calls
        self.heartbeats = 0  # heartbeats the router answered
        self._draining = False  # the last load sent said the worker drains
        # time.monotonic() of the last Register or heartbeat answered known (None: never)
        self.accepted_at: float | None = None
        self._registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._channel: Any = None
        self._stub: Any = None  # RegistryService stub on `_channel`, while running
        self._failing = ""  # the last failure, inside an outage: its repeats log at DEBUG

    def start(self) -> None:
        """Launch the background task (idempotent). Needs a running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="epd-registrar")

    async def wait_registered(self, timeout_s: float = 10.0) -> str:
        """The worker id once registered; TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            await self._registered.wait()
        assert self.worker_id is not None
        return self.worker_id

    def accepting(self, now: float) -> bool:
        """Whether the router accepts the worker at `now` (time.monotonic()): it registered
        the worker, or answered a heartbeat as known, within `STALE_HEARTBEATS` heartbeat
        intervals plus one RPC deadline (an answer may take that long)."""
        stale_s = STALE_HEARTBEATS * self.heartbeat_s + self.rpc_timeout_s
        return self.accepted_at is not None and now - self.accepted_at <= stale_s

    @property
    def failing(self) -> str:
        """The last failure to register or heartbeat ("" since the router last answered)."""
        return self._failing

    async def stop(self) -> None:
        """Cancel the task and close the channel (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    async def heartbeat_now(self) -> bool:
        """One heartbeat now, when registered; True when the router answered. Never raises
        (a failure is logged; the background task carries on)."""
        if self._stub is None or self.worker_id is None:
            return False
        try:
            await self._heartbeat(self._stub)
        except Exception as exc:
            self._log_failure("heartbeat", exc)
            return False
        return True

    def _log_failure(self, what: str, exc: BaseException) -> None:
        """A warning with the router's reason (a refusal says why: the model, the layout, a
        name in use); the same failure again only at debug level, another one warns again."""
        if isinstance(exc, grpc.aio.AioRpcError):
            detail = f"{exc.code().name}: {exc.details()}"
        else:
            detail = repr(exc)
        # Debug too while this worker drains: an orderly stop stops its routers first.
        quiet = self._failing == detail or self._draining
        level = logging.DEBUG if quiet else logging.WARNING
        logger.log(level, "%s with router %s failed: %s", what, self.router_address, detail)
        self._failing = detail

    async def _run(self) -> None:
        self._channel = channel(self.router_address, credentials=self.credentials)
        stub = self._stub = registry_service_pb2_grpc.RegistryServiceStub(self._channel)
        backoff = self.retry_initial_s
        while True:
            try:
                if self.worker_id is None:
                    await self._register(stub)
                    backoff = self.retry_initial_s
                else:  # just registered: the load goes at once (admission counts KV from it)
                    await asyncio.sleep(self.heartbeat_s)
                await self._heartbeat(stub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log_failure("register" if self.worker_id is None else "heartbeat", exc)
                self._forget()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.retry_max_s)

    async def _register(self, stub: Any) -> None:
        reply = await stub.Register(
            registry_service_pb2.RegisterRequest(worker=self.worker_info),
            timeout=self.rpc_timeout_s,
        )
        self.worker_id = reply.worker_id
        if reply.heartbeat_interval_ms > 0:
            self.heartbeat_s = reply.heartbeat_interval_ms / 1000.0
        self.registrations += 1
        self.accepted_at = time.monotonic()
        self._failing = ""
        self._registered.set()
        if self.on_registered is not None:
            self.on_registered()
        logger.info(
            "registered with %s as %s (heartbeat %.2fs)",
            self.router_address,
            self.worker_id,
            self.heartbeat_s,
        )

    async def _heartbeat(self, stub: Any) -> None:
        try:
            load = self.load_fn()
        except Exception:
            logger.exception("load_fn failed; sending an empty load")
            load = registry_service_pb2.WorkerLoad()
        self._draining = load.draining
        reply = await stub.Heartbeat(
            registry_service_pb2.HeartbeatRequest(worker_id=self.worker_id, load=load),
            timeout=self.rpc_timeout_s,
        )
        self.heartbeats += 1
        self._failing = ""
        if reply.known:
            self.accepted_at = time.monotonic()
        else:
            logger.info(
                "router %s forgot worker %s; registering again", self.router_address, self.worker_id
            )
            self._forget()

    def _forget(self) -> None:
        self.worker_id = None
        self._registered.clear()


class Registrations:
    """One `Registrar` per router (same worker info, load and credentials): the routers in
    `router_addresses`, plus, with `discover` ("host:port" whose name resolves to every
    router, e.g. a Kubernetes headless Service), one per address the name resolves to,
    re-resolved every `resolve_s`: a router that appears is registered with, one that
    left the answer is let go (a failed lookup changes nothing). `start`, `heartbeat_now`
    and `stop` act on all of them. `accepted()` says whether some router accepts the worker
    now (its readiness: `RoleServer.register`); `registered` is set on every acceptance by
    Register, for whoever waits on it to clear it."""

    def __init__(
        self,
        router_addresses: Sequence[str],
        worker_info: registry_service_pb2.WorkerInfo,
        load_fn: Callable[[], registry_service_pb2.WorkerLoad],
        *,
        credentials: ChannelCredentials = NO_CREDENTIALS,
        discover: str | None = None,
        resolve_s: float = 10.0,
        **options: float,
    ) -> None:
        """`options`: `Registrar`'s timing keywords (rpc_timeout_s, retry_initial_s, ...)."""

        # Set whenever a router registers the worker (a waiter clears it before waiting).
        self.registered = asyncio.Event()

        def make(address: str) -> Registrar:
            return Registrar(
                address,
                worker_info,
                load_fn,
                credentials=credentials,
                on_registered=self.registered.set,
                **options,
            )

        self._make = make  # a registrar for one router address
        self.registrars = [self._make(a) for a in dict.fromkeys(router_addresses)]
        self.discover = discover  # host:port naming every router (None: the list only)
        self.resolve_s = resolve_s  # seconds between lookups of `discover`
        self._found: dict[str, Registrar] = {}  # registrars of discovered addresses
        self._task: asyncio.Task[None] | None = None  # follows `discover`

    @property
    def router_addresses(self) -> list[str]:
        """The routers known now, in the order given, then as discovered."""
        return [r.router_address for r in self.registrars]

    def start(self) -> None:
        """Start registering with every router, and following `discover` (idempotent)."""
        for registrar in self.registrars:
            registrar.start()
        if self.discover and self._task is None:
            self._task = asyncio.create_task(self._follow(self.discover), name="epd-routers")

    def accepted(self) -> bool:
        """Whether some router known now accepts the worker (`Registrar.accepting`)."""
        now = time.monotonic()
        return any(r.accepting(now) for r in self.registrars)

    def failing(self) -> list[str]:
        """ "router: failure" for each router known now that last failed the worker's calls
        (unreachable, a TLS handshake, a token it refuses)."""
        return [f"{r.router_address}: {r.failing}" for r in self.registrars if r.failing]

    async def wait_registered(self, timeout_s: float = 10.0) -> list[str]:
        """The worker id each router known now gave, once they all registered the worker;
        TimeoutError after `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            return [await r.wait_registered(timeout_s) for r in list(self.registrars)]

    async def heartbeat_now(self) -> int:
        """One heartbeat to every router at once; how many answered."""
        answered = await asyncio.gather(*(r.heartbeat_now() for r in list(self.registrars)))
        return sum(answered)

    async def stop(self) -> None:
        """Stop following `discover`, then every registrar (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self.registrars))

    async def _follow(self, discover: str) -> None:
        host, _, port = discover.rpartition(":")
        while True:
            try:
                await self.track(await resolve_all(host, int(port)))
            except OSError as exc:
                logger.warning("looking up routers at %s failed: %s", discover, exc)
            await asyncio.sleep(self.resolve_s)

    async def track(self, addresses: Sequence[str]) -> None:
        """Register with each of `addresses` not known yet; let go of discovered routers
        not among them (routers given in the list stay)."""
        known = {r.router_address for r in self.registrars}
        for address in addresses:
            if address not in known:
                logger.info("router found at %s (%s)", address, self.discover)
                registrar = self._found[address] = self._make(address)
                self.registrars.append(registrar)
                registrar.start()
        for address in [a for a in self._found if a not in addresses]:
            logger.info("router at %s left %s; no longer registered there", address, self.discover)
            registrar = self._found.pop(address)
            await registrar.stop()  # listed until stopped: a `stop` cancelling this one's
            self.registrars.remove(registrar)  # stops it again (its channel was left open)


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as host:port ([v6]:port), sorted; OSError when the
    name does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    ips = {str(info[4][0]) for info in infos}
    return sorted(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)
