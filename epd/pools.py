"""Ray-managed worker pools: the router and one pool of worker actors per role.

Processes on a Ray cluster (all started by `Deployment.start`, i.e. `epd serve`):

    driver (epd serve) ── Controller actor (on the driver's node)
                             router server (router.server.serve, scaler = PoolManager.scale)
                             PoolManager ── WorkerActor "epd-encoder-0", "epd-prefill-0", ...
                                              each runs its role's server (serve(settings))

Lifecycles, in the order they happen:

- start: the driver starts or joins Ray and creates the Controller, whose async `__init__`
  starts the router and one actor per wanted replica. A WorkerActor's async `__init__` starts
  its role's gRPC server in the actor's event loop; that server registers itself with the
  router and heartbeats (`common.rpc.Registrar`). Ready = every wanted worker registered.
- restart: worker actors are created with `max_restarts` (default -1: always), so Ray
  re-runs `__init__` after a crash; the new server registers again (new port, same name).
- scale: `AdminService.Scale` → router → `PoolManager.scale`. Up: new actors, which register
  as they come up. Down: the newest workers retire in the background (see `drain` below).
- drain (one retiring worker): the router is told to stop routing to it (`AdminService.Drain`),
  the pool waits until the router has no request in flight on it, the worker waits until the
  leases it holds for peers are released (prefill KV blocks a decode worker has not pulled
  yet), then drains itself (refuses new work, finishes in-flight RPCs, stops its server,
  which ends its registration) and the actor is killed without restart.
- stop (SIGINT/SIGTERM to `epd serve`): the router drains first (no new requests, running
  ones finish on the workers they use) and stops; then every worker retires as above
  (without the router step), and the driver shuts down the Ray it started (a joined cluster
  is left running).

Ray's own objects carry only settings dataclasses and plain values between these actors; all
serving traffic is gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.rpc import channel
from epd.settings import ROLES, EpdSettings, PoolSettings, RaySettings
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc, registry_service_pb2

logger = logging.getLogger(__name__)

# The module whose `serve(settings)` runs each role's server.
SERVER_MODULES = {
    "router": "router.server",
    "encoder": "encoder_worker.server",
    "prefill": "prefill_worker.server",
    "decode": "decode_worker.server",
}
CONTROLLER_NAME = "epd-controller"
_WIRE_ROLES = {
    "encoder": registry_service_pb2.WORKER_ROLE_ENCODER,
    "prefill": registry_service_pb2.WORKER_ROLE_PREFILL,
    "decode": registry_service_pb2.WORKER_ROLE_DECODE,
}
_ROLE_NAMES: dict[int, str] = {int(v): k for k, v in _WIRE_ROLES.items()}
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_ANY = ("0.0.0.0", "::", "")


def wire_role(role: str) -> registry_service_pb2.WorkerRole:
    """The `WorkerRole` enum value of a role name ("encoder", "prefill", "decode")."""
    try:
        return _WIRE_ROLES[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}") from None


def role_name(value: int) -> str:
    """The role name of a wire `WorkerRole` value."""
    try:
        return _ROLE_NAMES[value]
    except KeyError:
        raise ValueError(f"worker role {value} is not encoder, prefill or decode") from None


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger().setLevel(level.upper())


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def reachable_address(listen_address: str) -> str:
    """The address others should dial for a server bound to `listen_address`.

    A wildcard host (0.0.0.0, ::) is replaced by this node's IP as Ray sees it.
    """
    host, _, port = listen_address.rpartition(":")
    if host.strip("[]") in _ANY:
        return f"{_node_ip()}:{port}"
    return listen_address


# ----------------------------------------------------------------------------- worker actor


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    """What a worker actor reports about itself."""

    role: str  # "encoder", "prefill" or "decode"
    name: str  # stable actor name, e.g. "epd-prefill-1"
    address: str  # gRPC address the server listens on and registered
    pid: int  # the actor's process id (changes when Ray restarts it)
    node_ip: str  # the Ray node it runs on


class WorkerActor:
    """One worker of a pool: the role's gRPC server, running in this actor's event loop.

    Made into a Ray actor by `PoolManager` (`ray.remote(WorkerActor).options(...)`). The
    async `__init__` runs again on every Ray restart, so a restarted worker serves and
    registers again without help from the pool.
    """

    # Ray runs an async actor's async __init__ in the actor's event loop (and again on restart).
    async def __init__(  # type: ignore[misc]
        self, role: str, name: str, settings: Any, log_level: str, host: str | None = None
    ) -> None:
        self.role = role
        self.name = name
        _setup_logging(log_level)
        # The listen (and registered) host is resolved here, on the node Ray placed us on:
        # None or a wildcard means this node's IP.
        if host is None or host in _ANY:
            host = _node_ip()
        if "host" in {f.name for f in dataclasses.fields(settings)}:
            settings = dataclasses.replace(settings, host=host)
        module = importlib.import_module(SERVER_MODULES[role])
        logger.info("%s: starting %s server", name, role)
        self.server = await module.serve(settings)
        logger.info("%s: %s server on %s", name, role, self.server.address)

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this: "(epd-prefill-1 pid=...)".
        return str(getattr(self, "name", "epd-worker"))

    async def describe(self) -> WorkerDescription:
        """Role, name, address, pid and node of this worker."""
        return WorkerDescription(self.role, self.name, self.server.address, os.getpid(), _node_ip())

    async def drain(self, timeout_s: float) -> bool:
        """Finish outstanding work (up to `timeout_s`), then stop the server and exit serving.

        Called once the router routes nothing new here. First the leases this worker holds
        for peers (prefill KV blocks, large encoder outputs a peer has not pulled yet) are
        given time to be released — their releases are RPCs this server must still answer —
        then the worker's lifecycle drains (refuses new work, in-flight RPCs finish) and the
        server stops, which also ends its registration. True when all of it finished in time.
        """
        deadline = time.monotonic() + timeout_s
        clean = await self._wait_leases(deadline)
        lifecycle = getattr(self.server, "lifecycle", None)
        if lifecycle is not None:
            clean = await lifecycle.drain(max(0.0, deadline - time.monotonic())) and clean
        await self.server.stop(0)
        logger.info("%s: drained (%s) and stopped", self.name, "clean" if clean else "timed out")
        return clean

    async def _wait_leases(self, deadline: float) -> bool:
        """Wait until the servicer holds no leases (`len(servicer.leases)`); False at the
        deadline. Workers without leases (decode) return at once."""
        leases = getattr(getattr(self.server, "servicer", None), "leases", None)
        if leases is None or not hasattr(leases, "__len__"):
            return True
        while len(leases) > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True


# ------------------------------------------------------------------------------ the pools


@dataclass(slots=True)
class _Member:
    """One worker actor of a pool, as the pool manager tracks it."""

    name: str  # actor name, unique in the namespace
    handle: Any  # Ray actor handle


@dataclass(slots=True)
class _Pool:
    """The live workers of one role, oldest first."""

    role: str
    members: list[_Member] = field(default_factory=list)
    next_index: int = 0  # suffix of the next actor name; never reused
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class PoolManager:
    """Creates, scales and retires the worker actors of every role.

    Runs inside the Controller actor, in the router's event loop; `scale` is the router's
    scaler. Workers are given `role_settings[role]` with the router address and listen host
    filled in. Retiring workers drain in background tasks that `stop` waits for.
    """

    def __init__(
        self,
        role_settings: dict[str, Any],
        pools: PoolSettings,
        *,
        router_address: str,
        worker_host: str | None,
        namespace: str,
        log_level: str,
        cluster_gpus: float,
        actor_class: Any = None,
    ) -> None:
        import ray

        self.role_settings = role_settings
        self.settings = pools
        self.router_address = router_address
        self.worker_host = worker_host
        self.namespace = namespace
        self.log_level = log_level
        self.gpus_per_worker = pools.gpus_per_worker(cluster_gpus)
        self.use_gpus = self.gpus_per_worker > 0
        self.pools = {role: _Pool(role) for role in ROLES}
        self._retiring: set[asyncio.Task[None]] = set()
        self.router_stopped = False  # set by stop() once the router is gone
        # The Ray actor class of the workers (tests pass a stand-in).
        self._actor_class = actor_class or ray.remote(WorkerActor)

    def replicas(self) -> dict[str, int]:
        """Workers each pool has or is moving to (retiring ones not counted)."""
        return {role: len(pool.members) for role, pool in self.pools.items()}

    def members(self, role: str) -> list[tuple[str, Any]]:
        """(actor name, handle) of each live worker of `role`, oldest first."""
        return [(m.name, m.handle) for m in self.pools[role].members]

    async def scale(self, role: str, replicas: int) -> int:
        """Move `role`'s pool to `replicas` workers; returns the new size.

        New workers are created at once and register as they come up; surplus workers (the
        newest) retire in the background: drain, then exit. Does not wait for either.
        """
        if role not in self.pools:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if not 0 <= replicas <= self.settings.max_replicas:
            raise ValueError(f"replicas must be in [0, {self.settings.max_replicas}]")
        pool = self.pools[role]
        async with pool.lock:
            while len(pool.members) < replicas:
                pool.members.append(self._create(pool))
            while len(pool.members) > replicas:
                member = pool.members.pop()
                task = asyncio.create_task(self._retire(role, member), name=f"retire-{member.name}")
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
            logger.info("pool %s: %d workers", role, len(pool.members))
            return len(pool.members)

    def _create(self, pool: _Pool) -> _Member:
        """Start one worker actor (it serves and registers on its own)."""
        name = f"epd-{pool.role}-{pool.next_index}"
        pool.next_index += 1
        settings = self._worker_settings(pool.role, name)
        handle = self._actor_class.options(
            name=name,
            namespace=self.namespace,
            num_cpus=self.settings.num_cpus,
            num_gpus=self.gpus_per_worker,
            max_restarts=self.settings.max_restarts,
            max_concurrency=1000,
        ).remote(pool.role, name, settings, self.log_level, self.worker_host)
        logger.info("started %s", name)
        return _Member(name, handle)

    def _worker_settings(self, role: str, name: str) -> Any:
        """The role's settings with this deployment's router and identity filled in (the
        host is filled in by the actor, on its own node)."""
        base = self.role_settings[role]
        changes: dict[str, Any] = {"router_address": self.router_address}
        names = {f.name for f in dataclasses.fields(base)}
        if "name" in names:
            changes["name"] = name
        if "device" in names and self.use_gpus and base.device == "cpu":
            # Ray gave the actor its GPU(s) through CUDA_VISIBLE_DEVICES: "cuda" is the first.
            changes["device"] = "cuda"
        return dataclasses.replace(base, **changes)

    async def _retire(self, role: str, member: _Member) -> None:
        """Drain one worker (router first, then the worker itself) and end its actor."""
        import ray

        timeout_s = self.settings.drain_timeout_s
        try:
            if not self.router_stopped:
                description = await asyncio.wait_for(member.handle.describe.remote(), timeout_s)
                await drain_at_router(self.router_address, description.address, timeout_s)
            clean = await asyncio.wait_for(member.handle.drain.remote(timeout_s), timeout_s + 5)
            logger.info("%s drained (%s)", member.name, "clean" if clean else "timed out")
        except Exception:
            logger.exception("draining %s failed; stopping it anyway", member.name)
        finally:
            ray.kill(member.handle, no_restart=True)
            logger.info("%s (%s) stopped", member.name, role)

    async def stop(self, *, router_stopped: bool = False) -> None:
        """Retire every worker and wait for all retirements to finish.

        `router_stopped`: the router no longer answers, so skip its drain step.
        """
        self.router_stopped = router_stopped
        for role in ROLES:
            await self.scale(role, 0)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)


async def drain_at_router(router_address: str, worker_address: str, timeout_s: float) -> None:
    """Tell the router to stop routing to a worker, then wait for its requests there to end.

    Waiting on the router's count (not only the worker's) matters for prefill workers: a
    request still needs the prefill worker after its Prefill RPC returned, until decode has
    pulled the KV blocks.
    """
    deadline = time.monotonic() + timeout_s
    async with channel(router_address) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        await stub.Drain(admin_service_pb2.DrainRequest(address=worker_address), timeout=10)
        while time.monotonic() < deadline:
            reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
            busy = [w.router_in_flight for w in reply.workers if w.info.address == worker_address]
            if not busy or busy[0] == 0:
                return
            await asyncio.sleep(0.1)
    logger.warning("router still has requests on %s after %.0fs", worker_address, timeout_s)


async def registered_counts(stub: Any, *, include_draining: bool = False) -> dict[str, int]:
    """Registered workers per role name, from `AdminService.Status` through `stub`.

    Draining workers are left out unless `include_draining` (a retiring worker still counts
    until it has left the registry).
    """
    reply = await stub.Status(admin_service_pb2.StatusRequest(), timeout=10)
    counts = dict.fromkeys(ROLES, 0)
    for worker in reply.workers:
        if worker.info.role in _ROLE_NAMES and (include_draining or not worker.draining):
            counts[role_name(worker.info.role)] += 1
    return counts


# ------------------------------------------------------------------------------ controller


class WorkerStartError(RuntimeError):
    """A worker actor (or the controller) raised while starting; the message has the cause."""


def error_summary(exc: BaseException | None) -> str:
    """The last line of a (Ray) error: the exception that started it all."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else repr(exc)
    return last.removeprefix(f"{__name__}.{WorkerStartError.__name__}: ")


class Controller:
    """The head of a deployment: the router server plus the pool manager, in one actor.

    Made into a Ray actor by `Deployment.start`, pinned to the driver's node so the router
    listens where `epd serve` said it would.
    """

    async def __init__(  # type: ignore[misc]
        self, settings: EpdSettings, worker_host: str | None
    ) -> None:
        import ray

        _setup_logging(settings.log_level)
        settings = settings.with_model()  # a top-level `model` reaches the router too
        self.settings = settings
        router_module = importlib.import_module(SERVER_MODULES["router"])
        self.router = await router_module.serve(settings.router, scaler=self._scale)
        self.router_address = reachable_address(self.router.address)
        loopback = self.router_address.rsplit(":", 1)[0] in _LOOPBACK
        if loopback and len([n for n in ray.nodes() if n.get("Alive")]) > 1:
            logger.warning(
                "router listens on %s but the Ray cluster has several nodes: workers on other "
                'nodes cannot reach it (set [router] host = "0.0.0.0")',
                self.router_address,
            )
        if worker_host is None and loopback:
            worker_host = "127.0.0.1"
        self.pools = PoolManager(
            settings.role_settings(),
            settings.pools,
            router_address=self.router_address,
            worker_host=worker_host,
            namespace=settings.ray.namespace,
            log_level=settings.log_level,
            cluster_gpus=float(ray.cluster_resources().get("GPU", 0)),
        )
        for role, replicas in settings.pools.initial_replicas().items():
            await self.pools.scale(role, replicas)

    def __repr__(self) -> str:
        return CONTROLLER_NAME

    async def _scale(self, role: Any, replicas: int) -> int:
        """The router's scaler: `role` as a wire enum value or a name."""
        name = str(role) if isinstance(role, str) else role_name(int(role))
        return await self.pools.scale(name, int(replicas))

    async def address(self) -> str:
        """The router's address, as workers and clients dial it."""
        return self.router_address

    async def wait_ready(self, timeout_s: float) -> dict[str, int]:
        """Wait until every pool has as many registered workers as it should.

        Returns the registered count per role; TimeoutError after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        # One describe() per worker resolves once its actor is up, or fails with the error
        # its __init__ raised (Ray does not restart an actor whose creation task failed).
        probes: dict[str, asyncio.Future[Any]] = {}
        while True:
            wanted = self.pools.replicas()
            for role in ROLES:
                for name, handle in self.pools.members(role):
                    if name not in probes:
                        probes[name] = asyncio.ensure_future(handle.describe.remote())
            for name, probe in probes.items():
                if probe.done() and probe.exception() is not None:
                    cause = error_summary(probe.exception())
                    raise WorkerStartError(f"{name} failed to start: {cause}")
            try:
                async with channel(self.router_address) as ch:
                    stub = admin_service_pb2_grpc.AdminServiceStub(ch)
                    have = await registered_counts(stub)
            except grpc.aio.AioRpcError:
                have = dict.fromkeys(wanted, 0)
            if all(have[role] >= n for role, n in wanted.items()):
                return have
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"workers not registered after {timeout_s:.0f}s: have {have}, want {wanted} "
                    "(actors waiting for resources? see `ray status`)"
                )
            await asyncio.sleep(0.2)

    async def workers(self) -> list[WorkerDescription]:
        """Every live worker actor's description (skips ones that do not answer)."""
        out = []
        for role in ROLES:
            for name, handle in self.pools.members(role):
                try:
                    out.append(await asyncio.wait_for(handle.describe.remote(), 10))
                except Exception:
                    logger.info("%s did not describe itself", name)
        return out

    async def shutdown(self) -> None:
        """Drain the router (no new requests; running ones finish), then retire every worker.

        The router goes first so that no request starts on a worker that is about to leave;
        its in-flight requests still have every worker they need while it drains.
        """
        lifecycle = getattr(self.router, "lifecycle", None)
        if lifecycle is not None:
            await lifecycle.drain(self.settings.pools.drain_timeout_s)
        await self.router.stop(self.settings.router.grace_s)
        await self.pools.stop(router_stopped=True)


# ------------------------------------------------------------------------------ the driver


def init_ray(settings: RaySettings) -> bool:
    """Join the Ray cluster at `settings.address`, or start a local one; True if started here."""
    import ray

    if settings.address:
        ray.init(
            address=settings.address,
            namespace=settings.namespace,
            log_to_driver=settings.log_to_driver,
        )
        return False
    ray.init(
        address="local",  # always a new cluster, even when `ray start` left one running here
        num_cpus=settings.num_cpus,
        num_gpus=settings.num_gpus,
        namespace=settings.namespace,
        include_dashboard=False,
        object_store_memory=settings.object_store_mb * 1024 * 1024,
        log_to_driver=settings.log_to_driver,
    )
    return True


class Deployment:
    """The driver's handle on a running deployment (the Controller actor).

    `start` → `wait_ready` → (serve until told to stop) → `stop`.
    """

    def __init__(self, settings: EpdSettings, controller: Any, started_ray: bool) -> None:
        self.settings = settings
        self.controller = controller
        self.started_ray = started_ray
        self.address = ""  # router address, set by start

    @classmethod
    async def start(cls, settings: EpdSettings, *, started_ray: bool) -> Deployment:
        """Create the Controller (router + initial pools) on this node; Ray must be up."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        controller = (
            ray.remote(Controller)
            .options(
                name=CONTROLLER_NAME,
                namespace=settings.ray.namespace,
                num_cpus=0,
                max_restarts=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
            )
            .remote(settings, settings.ray.worker_host or ("127.0.0.1" if started_ray else None))
        )
        deployment = cls(settings, controller, started_ray)
        try:
            deployment.address = await controller.address.remote()
        except ray.exceptions.RayActorError as exc:
            raise WorkerStartError(f"the router failed to start: {error_summary(exc)}") from None
        return deployment

    async def wait_ready(self, timeout_s: float) -> dict[str, int]:
        """Registered workers per role once every pool is complete."""
        return dict(await self.controller.wait_ready.remote(timeout_s))

    async def workers(self) -> list[WorkerDescription]:
        """Every worker actor's description."""
        return list(await self.controller.workers.remote())

    async def alive(self) -> bool:
        """False once the Controller actor has died."""
        try:
            await asyncio.wait_for(self.controller.address.remote(), 30)
            return True
        except Exception:
            return False

    async def stop(self, on_step: Callable[[str], None] = lambda _: None) -> None:
        """Drain and stop every worker, stop the router, end the Controller and our Ray."""
        import ray

        on_step("draining workers and stopping the router")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.controller.shutdown.remote(), self.settings.pools.drain_timeout_s + 30
            )
        with contextlib.suppress(Exception):
            ray.kill(self.controller, no_restart=True)
        if self.started_ray:
            on_step("stopping the local Ray cluster")
            ray.shutdown()
