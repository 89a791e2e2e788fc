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
from collections.abc import Callable
from typing import Any

import grpc

from cluster.pools import (
    _LOOPBACK,
    CONTROLLER_NAME,
    SERVER_MODULES,
    PoolManager,
    WorkerDescription,
    WorkerStartError,
    _setup_logging,
    error_summary,
    reachable_address,
    registered_counts,
)
from cluster.settings import ROLES, EpdSettings, RaySettings
from common.server.auth import service_credentials
from common.server.rpc import channel
from common.wire.roles import role_from_proto
from epd.v1 import admin_service_pb2_grpc

logger = logging.getLogger(__name__)


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
        # `pools.routers` > 1: more routers here, each its own registry; workers join all.
        self.more_routers = [
            await router_module.serve(settings.router.nth(i), scaler=self._scale)
            for i in range(1, settings.pools.routers)
        ]
        self.router_addresses = [self.router_address]
        self.router_addresses += [reachable_address(r.address) for r in self.more_routers]
        # The controller's own calls to the router (Status, Drain) present the cluster bearer.
        self.credentials = service_credentials(settings.router.security)
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
            router_addresses=self.router_addresses[1:],
            worker_host=worker_host,
            namespace=settings.ray.namespace,
            log_level=settings.log_level,
            cluster_gpus=float(ray.cluster_resources().get("GPU", 0)),
            credentials=self.credentials,
        )
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

    async def http_address(self) -> str | None:
        """The router's HTTP API address, as clients dial it (None: off)."""
        http = self.router.http_address
        return reachable_address(http) if http else None

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
                async with channel(self.router_address, credentials=self.credentials) as ch:
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
        timeout_s = self.settings.pools.drain_timeout_s
        await asyncio.gather(*(r.drain(timeout_s) for r in [self.router, *self.more_routers]))
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
        self.addresses: list[str] = []  # every router's address (`address` first), by start
        self.http_address: str | None = None  # router's HTTP API address, set by start

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
            deployment.addresses = list(await controller.addresses.remote())
            deployment.http_address = await controller.http_address.remote()
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
