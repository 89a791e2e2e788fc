"""The deployment's head and driver: the Controller actor (router server plus PoolManager)
and `Deployment`, which `epd serve` uses to start Ray, the controller and the pools, wait
until ready, scale, and stop. Lifecycles are described in `cluster.pools`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from cluster.actor_states import WorkerRefusedError, WorkerStartError, error_summary
from cluster.hints import RAY_ASKS_HINT
from cluster.placement import CpuPlanner
from cluster.pools import CONTROLLER_NAME, WAITS_FOR_RAY, PoolManager, registered_counts
from cluster.ray_start import RUNNING
from cluster.settings import ROLES, EpdSettings, PoolSettings
from cluster.worker import (
    LOOPBACK,
    SERVER_MODULES,
    WorkerDescription,
    reachable_address,
    setup_logging,
)
from common.server.auth import service_credentials
from common.server.role import freeze_startup_heap
from common.server.rpc import channel
from common.server.threads import available_cores
from common.wire.roles import role_from_proto
from epd.v1 import admin_service_pb2_grpc

if TYPE_CHECKING:
    from router.registry import Registry

logger = logging.getLogger(__name__)


class _Scaler:
    """The router's scaler (`router.admin.Scaler`), with `waiting` for AdminService.Status
    (the workers Ray has not placed yet or restarts, asked at most every 2 s: `survey`, which
    takes the workers dead for good out of their pools), `failed` (the workers that failed
    to start or died for good: `PoolManager.failures`) and `replaced` (a scale's)."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._waiting: list[str] = []
        self._asked = 0.0

    async def __call__(self, role: Any, replicas: int) -> int:
        return await self.controller._scale(role, replicas)

    async def waiting(self) -> list[str]:
        pools = getattr(self.controller, "pools", None)  # None while the router starts
        if pools is not None and time.monotonic() - self._asked > 2.0:
            self._asked = time.monotonic()
            self._waiting = await pools.survey()
        return list(self._waiting)

    async def failed(self) -> list[str]:
        pools = getattr(self.controller, "pools", None)
        return pools.failures() if pools is not None else []

    async def replaced(self, role: Any) -> list[str]:
        return list(self.controller.pools.replaced(str(role)))  # after a scale: pools exist


class Controller:
    """The head of a deployment: the router server plus the pool manager, in one actor.

    Made into a Ray actor by `Deployment.start`, pinned to the driver's node so the router
    listens where `epd serve` said it would.
    """

    async def __init__(  # type: ignore[misc]
        self, settings: EpdSettings, worker_host: str | None
    ) -> None:
        import ray

        setup_logging(settings.log_level)
        settings = settings.with_model()  # a top-level `model` reaches the router too
        self.settings = settings
        self.registered: dict[str, int] = {}  # per role, as `wait_ready` last counted
        router_module = importlib.import_module(SERVER_MODULES["router"])
        scaler = _Scaler(self)  # every router's: each tells what waits and what failed
        self.router = await router_module.serve(settings.router, scaler=scaler)
        self.router_address = reachable_address(self.router.address)
        # `pools.routers` > 1: more routers here, each its own registry; workers join all.
        self.more_routers = [
            await router_module.serve(settings.router.nth(i), scaler=scaler)
            for i in range(1, settings.pools.routers)
        ]
        freeze_startup_heap()  # the routers' processors, registries and settings
        self.router_addresses = [self.router_address]
        self.router_addresses += [reachable_address(r.address) for r in self.more_routers]
        # The controller's own calls to the router (Status, Drain) present the cluster bearer.
        self.credentials = service_credentials(settings.router.security)
        loopback = self.router_address.rsplit(":", 1)[0] in LOOPBACK
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
            router_addresses=self.router_addresses[1:],
            worker_host=worker_host,
            namespace=settings.ray.namespace,
            log_level=settings.log_level,
            cluster_gpus=float(ray.cluster_resources().get("GPU", 0)),
            credentials=self.credentials,
            cpu=cpu_planner(settings.pools),
        )
        follow_registries(self.pools, [r.registry for r in (self.router, *self.more_routers)])
        for role, replicas in settings.pools.initial_replicas().items():
            await self.pools.scale(role, replicas)

    def __repr__(self) -> str:
        return CONTROLLER_NAME

    async def _scale(self, role: Any, replicas: int) -> int:
        """The router's scaler: `role` as a wire enum value or a name."""
        name = str(role) if isinstance(role, str) else str(role_from_proto(int(role)))
        return await self.pools.scale(name, int(replicas))

    async def address(self) -> str:
        """The router's address, as workers and clients dial it."""
        return self.router_address

    async def addresses(self) -> list[str]:
        """Every router's address (the first is `address`)."""
        return list(self.router_addresses)

    async def http_addresses(self) -> list[str]:
        """Every router's HTTP API address, as clients dial it (none: off)."""
        routers = (self.router, *self.more_routers)
        return [reachable_address(r.http_address) for r in routers if r.http_address]

    async def wait_ready(self, timeout_s: float) -> dict[str, int]:
        """Wait until every pool has as many registered workers as it should.

        Returns the registered count per role; WorkerStartError once a worker's start
        failed (`PoolManager.failures`), TimeoutError after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            wanted = self.pools.replicas()
            for failure in self.pools.failures():  # dead for good: Ray restarts it no more
                raise WorkerStartError(failure)
            for reason in self.router.registry.refusals.values():
                # Refused for its settings (model, protocol, KV layout): retrying cannot help.
                raise WorkerRefusedError(f"the router refused a worker: {reason}")
            try:
                async with channel(self.router_address, credentials=self.credentials) as ch:
                    stub = admin_service_pb2_grpc.AdminServiceStub(ch)
                    have = await registered_counts(stub)
            except grpc.aio.AioRpcError:
                have = dict.fromkeys(wanted, 0)
            self.registered = have
            if all(have[role] >= n for role, n in wanted.items()):
                return have
            if time.monotonic() > deadline:
                waiting = await self.pools.survey()
                why = "; ".join(waiting) if waiting else "placed, not registered: see their logs"
                raise TimeoutError(
                    f"workers not registered after {timeout_s:.0f}s: have {have}, want {wanted} "
                    f"({why})"
                )
            await asyncio.sleep(0.2)

    async def progress(self) -> str:
        """How far start-up is, for `epd serve` while it waits: workers registered per
        pool, then the workers Ray has not placed yet with what they ask for, and those up
        whose calls to a router fail (a TLS handshake, a token it refuses: they cannot
        register); the others are loading their model."""
        wanted = self.pools.replicas()
        have = self.registered
        short = [f"{role} {have.get(role, 0)}/{n}" for role, n in wanted.items()]
        waiting = await self.pools.survey()
        done = sum(min(have.get(role, 0), n) for role, n in wanted.items())
        line = f"{done} of {sum(wanted.values())} workers registered ({', '.join(short)})"
        if done == sum(wanted.values()):
            return line
        unregistered = [role for role, n in wanted.items() if have.get(role, 0) < n]
        failing = await self._failing(unregistered)
        if waiting or failing:
            return "; ".join([line, *waiting, *failing])
        return f"{line}; the rest load their model"

    async def _failing(self, roles: list[str]) -> list[str]:
        """ "names cannot register: why" for the workers of `roles` that are up (3 s to
        answer: those still loading do not) and whose calls to a router fail, one line per
        failure."""

        async def failing(handle: Any) -> tuple[str, ...]:
            try:
                async with asyncio.timeout(3.0):
                    return tuple((await handle.describe.remote()).failing)
            except Exception:  # loading its model still, or gone
                return ()

        # Not those still starting: Ray queues the call until they have (one per line).
        members = [m for role in roles for m in self.pools.members(role, started=True)]
        said = await asyncio.gather(*(failing(handle) for _, handle in members))
        who: dict[str, list[str]] = {}  # why -> the workers it stops (one line each why)
        for (name, _), whys in zip(members, said, strict=True):
            for why in whys:
                who.setdefault(why[:300], []).append(name)
        return [f"{', '.join(names)} cannot register: {why}" for why, names in who.items()]

    async def workers(self) -> list[WorkerDescription]:
        """Every live worker actor's description (skips ones that do not answer)."""
        out = []
        for role in ROLES:
            for name, handle in self.pools.members(role):
                try:
                    async with asyncio.timeout(10):
                        out.append(await handle.describe.remote())
                except Exception:
                    logger.info("%s did not describe itself", name)
        return out

    async def shutdown(self) -> None:
        """Drain the routers (no new requests; running ones finish), retire every worker,
        then stop the routers.

        The routers drain first so that no request starts on a worker that is about to
        leave; their in-flight requests still have every worker they need meanwhile. They
        stop last: stopped first, every worker logged a failed heartbeat as it retired. A
        drain that runs out of time stops them at once (their streams cancelled: each
        worker's drain would wait for those as long again).
        """
        timeout_s = self.settings.pools.drain_timeout_s
        routers = [self.router, *self.more_routers]
        self.pools.stopping = True  # a Scale meanwhile starts none (it is told why)
        drains = await asyncio.gather(*(r.lifecycle.drain(timeout_s, stop=False) for r in routers))
        if not all(drains):
            await asyncio.gather(*(r.stop(0) for r in routers))
        try:
            await self.pools.stop(routers_drained=True)  # nothing left on them to wait for
        finally:  # a short grace for what a drain does not track (health watches, releases)
            await asyncio.gather(*(r.stop(0.5) for r in routers))


def follow_registries(pools: PoolManager, registries: Sequence[Registry]) -> None:
    """Tie the pools to the routers' registries (the first router's first): the pools hear
    which workers registered (those drain when stopping; one that never did is stopped at
    once) and which an operator drained (those retire first, restarted or not), and a
    worker they retire is held out of rotation at every router at once, whatever an undrain
    or its registering again says (`Registry.retire`)."""
    registered = pools.registered
    registries[0].on_register.append(lambda record: registered.add(record.name))
    pools.drained = lambda name: any(r.drained_by_operator(name) for r in registries)

    def retiring(name: str, died: bool = False) -> None:
        for registry in registries:
            registry.retire(name, died)

    pools.retiring = retiring


def cpu_planner(pools: PoolSettings) -> CpuPlanner:
    """The CPU plan of this Ray cluster (run in the controller, on the driver's node): with
    one alive node, its cores as this process may use them, at most Ray's CPU count, pinned;
    with several, the smallest CPU count of the nodes that have CPUs, unpinned
    (`cluster.placement`)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    # Nodes without CPUs (a KubeRay head started with num-cpus 0) host no workers.
    cpus = [c for n in alive if (c := int(n.get("Resources", {}).get("CPU", 0))) > 0] or [1]
    workers = sum(pools.initial_replicas().values())
    if len(cpus) == 1 and len(alive) == 1:
        cores = available_cores()[: cpus[0]]
    else:
        cores = tuple(range(min(cpus)))
    return CpuPlanner.for_cluster(cores, len(cpus), workers, pools.num_cpus)


# ------------------------------------------------------------------------------ the driver


WAIT_REPORT_S = 10.0  # how often `epd serve` says how far start-up is


class Deployment:
    """The driver's handle on a running deployment (the Controller actor).

    `start` → `wait_ready` → (serve until told to stop) → `stop`.
    """

    def __init__(self, settings: EpdSettings, controller: Any, started_ray: bool) -> None:
        self.settings = settings
        self.controller = controller
        self.started_ray = started_ray
        self.address = ""  # router address, set by start
        self.addresses: list[str] = []  # every router's address (`address` first), by start
        self.http_addresses: list[str] = []  # every router's HTTP API address, by start

    @classmethod
    async def start(cls, settings: EpdSettings, *, started_ray: bool) -> Deployment:
        """Create the Controller (router + initial pools) on this node; Ray must be up."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        options = ray.remote(Controller).options(
            name=CONTROLLER_NAME,
            namespace=settings.ray.namespace,
            num_cpus=0,
            max_restarts=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        )
        worker_host = settings.ray.worker_host or ("127.0.0.1" if started_ray else None)
        try:
            controller = options.remote(settings, worker_host)
        except ray.exceptions.ActorAlreadyExistsError:
            from common.settings.schema import SettingsError

            raise SettingsError(RUNNING.format(namespace=settings.ray.namespace)) from None
        deployment = cls(settings, controller, started_ray)
        try:
            deployment.address = await controller.address.remote()
            deployment.addresses = list(await controller.addresses.remote())
            deployment.http_addresses = list(await controller.http_addresses.remote())
        except ray.exceptions.RayActorError as exc:
            raise WorkerStartError(f"the router failed to start: {error_summary(exc)}") from None
        return deployment

    async def wait_ready(
        self, timeout_s: float, on_wait: Callable[[str], None] = lambda _: None
    ) -> dict[str, int]:
        """Registered workers per role once every pool is complete. Every `WAIT_REPORT_S`
        until then, `on_wait` gets a progress line (`Controller.progress`)."""
        ready = asyncio.ensure_future(self.controller.wait_ready.remote(timeout_s))
        started, hinted = time.monotonic(), False
        try:
            while True:
                done, _ = await asyncio.wait({ready}, timeout=WAIT_REPORT_S)
                if done:
                    return dict(ready.result())
                with contextlib.suppress(Exception):
                    progress = await self.controller.progress.remote()
                    on_wait(f"still waiting ({time.monotonic() - started:.0f}s): {progress}")
                    if WAITS_FOR_RAY in progress and not hinted:  # once: what to change
                        on_wait(f"  {RAY_ASKS_HINT}")
                        hinted = True
        finally:  # stopped meanwhile: its outcome is no news (a traceback at exit: raypools)
            ready.cancel()
            ready.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def workers(self) -> list[WorkerDescription]:
        """Every worker actor's description."""
        return list(await self.controller.workers.remote())

    async def alive(self) -> bool:
        """False once the Controller actor has died."""
        try:
            async with asyncio.timeout(30):
                await self.controller.address.remote()
            return True
        except Exception:
            return False

    async def stop(self, on_step: Callable[[str], None] = lambda _: None) -> None:
        """Drain and stop every worker, stop the router, end the Controller and our Ray."""
        import ray

        on_step("draining workers and stopping the router")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.pools.drain_timeout_s + 30):
                await self.controller.shutdown.remote()
        with contextlib.suppress(Exception):
            ray.kill(self.controller, no_restart=True)
        if self.started_ray:
            on_step("stopping the local Ray cluster")
            ray.shutdown()

    def kill(self) -> None:
        """Stop now, without a drain (a signal during `stop`): kill the Controller (its
        router, and the worker actors it owns, end with it) and shut down our Ray (the local
        cluster `epd serve` started; a joined one is only left)."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.controller, no_restart=True)
        ray.shutdown()
