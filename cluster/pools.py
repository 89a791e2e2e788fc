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
  router and heartbeats (`common.server.registrar.Registrar`). Ready = every wanted worker
  registered.
- restart: worker actors are created with `max_restarts` (default -1: always), so Ray
  re-runs `__init__` after a crash; the new server registers again (new port, same name).
- scale: `AdminService.Scale` → router → `PoolManager.scale`. Up: new actors, which register
  as they come up. Down: the workers an operator drained (restarted since or not), then the
  newest, retire in the background (see `drain` below); each is held out of rotation at
  every router at once (`Registry.retire`: no undrain puts it back). One that never
  registered (still loading its model) is killed at once.
- drain (one retiring worker): the router is told to stop routing to it (`AdminService.Drain`),
  the pool waits until the router has no request in flight on it, the worker waits until the
  leases it holds for peers are released (prefill KV blocks a decode worker has not pulled
  yet), then drains itself (refuses new work, finishes in-flight RPCs, stops its server,
  which ends its registration) and the actor is killed without restart.
- stop (SIGINT/SIGTERM to `epd serve`): the router drains first (no new requests, running
  ones finish on the workers they use) and stops; then every worker retires as above
  (without the router step), and the driver shuts down the Ray it started (a joined cluster
  is left running). A second signal meanwhile cuts the drain: the controller is killed
  (its workers end with it) and Ray shut down at once (`cluster.serve`).

Ray's own objects carry only settings dataclasses and plain values between these actors; all
serving traffic is gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cluster.actor_states import (
    ActorStates,
    actor_id,
    actor_states,
    death,
    error_summary,
    start_outcome,
)

# These live in cluster.admin, which `epd scale` imports without torch.
from cluster.admin import drain_at_router
from cluster.admin import registered_counts as registered_counts
from cluster.placement import CpuPlanner
from cluster.settings import ROLES, PoolSettings, one_worker_ports
from cluster.worker import WorkerActor
from common.server.credentials import NO_CREDENTIALS, ChannelCredentials
from common.server.threads import available_cores
from common.settings.base import ModelWorkerSettings

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "epd-controller"
START_RETRY_S = 1.0  # between asks whether a worker has started, after one failed
WAITS_FOR_RAY = "waits for Ray resources"  # a worker Ray has nowhere to place yet
ASK_RAY_S = 4.0  # the longest one question to Ray waits (a status asks two; epd's calls, 10 s)


# ------------------------------------------------------------------------------ the pools


def _lines(failed: dict[str, str]) -> list[str]:
    return [f"{name} {end}" for name, end in failed.items()]


def _amount(resource: str, value: float) -> str:
    """`resource value` as Ray counts it; memory (bytes) in MiB."""
    if resource == "memory":
        return f"memory {value / (1 << 20):.0f} MiB"
    return f"{resource} {value:g}"


@dataclass(slots=True)
class _Member:
    """One worker actor of a pool, as the pool manager tracks it."""

    name: str  # actor name, unique in the namespace
    handle: Any  # Ray actor handle
    request: dict[str, float] = field(default_factory=dict)  # what it asked Ray for
    started: bool = False  # its actor started once (Ray may restart it since)


@dataclass(slots=True)
class _Pool:
    """The live workers of one role, oldest first."""

    role: str
    members: list[_Member] = field(default_factory=list)
    next_index: int = 0  # suffix of the next actor name; never reused
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failed: dict[str, str] = field(default_factory=dict)  # since the last scale: name -> end
    replaced: list[str] = field(default_factory=list)  # the last scale's: `failures` lines


class PoolManager:
    """Creates, scales and retires the worker actors of every role.

    Runs inside the Controller actor, in the router's event loop; `scale` is the router's
    scaler. Workers are given `role_settings[role]` with the router address and listen host
    filled in. Retiring workers drain in background tasks that `stop` waits for.
    """

    def __init__(
        self,
        role_settings: dict[str, ModelWorkerSettings],
        pools: PoolSettings,
        *,
        router_address: str,
        worker_host: str | None,
        namespace: str,
        log_level: str,
        cluster_gpus: float,
        actor_class: Any = None,
        credentials: ChannelCredentials = NO_CREDENTIALS,
        cpu: CpuPlanner | None = None,
        router_addresses: Sequence[str] = (),
    ) -> None:
        import ray

        self.role_settings = role_settings
        self.settings = pools
        self.router_address = router_address
        # The deployment's other routers: workers register with them too, and drain there.
        self.router_addresses = tuple(router_addresses)
        self.worker_host = worker_host
        self.namespace = namespace
        self.log_level = log_level
        self.gpus_per_worker = pools.gpus_per_worker(cluster_gpus)
        self.use_gpus = self.gpus_per_worker > 0
        self.pools = {role: _Pool(role) for role in ROLES}
        self._retiring: set[asyncio.Task[None]] = set()
        self._starting: set[asyncio.Task[None]] = set()  # `_watch_start`, one a new worker
        self._ray_state = ThreadPoolExecutor(1, thread_name_prefix="epd-ray-state")
        self.routers_drained = False  # set by stop(): the routers take no new work
        self.stopping = False  # set by stop(), or the deployment's shutdown before it
        # The deployment's view of its routers (the controller sets both,
        # `cluster.deployment.follow_registries`): whether an operator drained the worker of
        # this name, and one retiring now, held out of rotation at once (told before `scale`
        # returns, so what `epd scale` counts right after is already true).
        self.drained: Callable[[str], bool] = lambda name: False
        self.retiring: Callable[[str, bool], None] = lambda name, died: None  # (died for good)
        # Workers that registered at least once (the controller adds them as the router
        # sees them); one that never did is stopped without a drain once the router is gone.
        self.registered: set[str] = set()
        self.credentials = credentials  # presented to the router (Drain, Status): the cluster
        # Threads, Ray CPUs and cores of each worker (default: this node alone, unpinned).
        workers = max(1, sum(pools.initial_replicas().values()))
        self.cpu = cpu or CpuPlanner(available_cores(), workers, pin=False, num_cpus=pools.num_cpus)
        # The Ray actor class of the workers (tests pass a stand-in).
        self._actor_class = actor_class or ray.remote(WorkerActor)

    def replicas(self) -> dict[str, int]:
        """Workers each pool has or is moving to (retiring ones not counted)."""
        return {role: len(pool.members) for role, pool in self.pools.items()}

    def members(self, role: str, *, started: bool = False) -> list[tuple[str, Any]]:
        """(actor name, handle) of each live worker of `role` (`started`: whose actor has
        started), oldest first."""
        return [(m.name, m.handle) for m in self.pools[role].members if m.started or not started]

    async def scale(self, role: str, replicas: int) -> int:
        """Move `role`'s pool to `replicas` workers; returns the new size.

        New workers are created at once and register as they come up; surplus workers (those
        an operator drained, then the newest) retire in the background: drain, then exit.
        Does not wait for either. The workers dead for good that it replaces: `replaced`.
        """
        if role not in self.pools:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if not 0 <= replicas <= self.settings.max_replicas:
            raise ValueError(
                f"replicas must be in [0, {self.settings.max_replicas}] "
                "([pools] max_replicas, --pools-max-replicas)"
            )
        one_worker_ports(role, self.role_settings[role], replicas, "the replicas asked")
        pool = self.pools[role]
        async with pool.lock:
            if self.stopping and replicas:
                raise ValueError("the deployment is stopping")
            before = _lines(pool.failed)
            pool.failed.clear()  # a new attempt: the workers that failed before are gone
            if pool.members and replicas:  # the dead are no members: not counted nor retired
                await self._reap([pool])  # (and told: `failures`, until the next scale)
                if self.stopping:  # set while Ray answered (s41 review F4)
                    raise ValueError("the deployment is stopping")
            pool.replaced = before + _lines(pool.failed)  # what this scale replaces
            while len(pool.members) < replicas:
                member = self._create(pool)
                pool.members.append(member)
                task = asyncio.create_task(self._watch_start(pool, member), name=member.name)
                self._starting.add(task)
                task.add_done_callback(self._starting.discard)
            while len(pool.members) > replicas:
                # The newest, unless an operator drained one: that one leaves first.
                drained = [m for m in pool.members if self.drained(m.name)]
                member = drained[-1] if drained else pool.members[-1]
                pool.members.remove(member)
                self.retiring(member.name, False)
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
        placement, num_cpus = self.cpu.take(name, getattr(settings, "threads", 0))
        memory = self.settings.memory_per_worker(settings.model, settings.device)
        handle = self._actor_class.options(
            name=name,
            namespace=self.namespace,
            num_cpus=num_cpus,
            num_gpus=self.gpus_per_worker,
            memory=memory,
            max_restarts=self.settings.max_restarts,
            max_concurrency=1000,
        ).remote(pool.role, name, settings, self.log_level, self.worker_host, placement)
        logger.info("started %s", name)
        request = {"CPU": num_cpus, "GPU": self.gpus_per_worker, "memory": float(memory)}
        return _Member(name, handle, request)

    async def _watch_start(self, pool: _Pool, member: _Member) -> None:
        """Wait until `member`'s actor has started (`start_outcome`). One dead for good
        before it did leaves its pool (kept, it was a member that never served, and scaling
        to the same size started none): `_failed`."""
        gone = lambda: member not in pool.members  # noqa: E731 (retired meanwhile)
        ended = await start_outcome(member.handle, gone, START_RETRY_S)
        if ended is None:
            member.started = True
        else:
            self._failed(pool, member, death(ended, started=False))

    async def _reap(self, pools: list[_Pool]) -> ActorStates:
        """Ask Ray about every member of `pools` (`actor_states`, on the pools' thread for
        Ray's state: a GCS that does not answer holds that one, not the loop's executor);
        those dead for good since they started (they died past their restarts, or a restart
        raised) leave their pool as failed ones (`_failed`). One still starting is its start
        watch's to tell."""
        ids = [actor_id(m.handle) for pool in pools for m in pool.members]
        loop = asyncio.get_running_loop()
        try:  # a Ray that does not answer holds no scale nor `stop` (under the pool's lock)
            async with asyncio.timeout(ASK_RAY_S):
                states = await loop.run_in_executor(self._ray_state, actor_states, ids)
                for pool in pools:
                    for m in [m for m in pool.members if m.started]:
                        if actor_id(m.handle) in states.dead:
                            ended = await start_outcome(m.handle, lambda: True, START_RETRY_S)
                            if ended is not None:  # Ray's error for a call on it: the cause
                                self._failed(pool, m, death(ended, started=True))
        except TimeoutError:
            logger.warning("Ray did not tell within %.0f s which workers are dead", ASK_RAY_S)
            return ActorStates()
        return states

    def _failed(self, pool: _Pool, member: _Member, end: str) -> None:
        """`member` is dead for good: it leaves its pool, `end` kept in `pool.failed`
        (`failures`) until the pool is scaled again, which starts another; the routers
        stop counting it at once (`retiring`: its registration lasts until it times out)."""
        import ray

        if member not in pool.members:  # retired meanwhile, or told already
            return
        pool.members.remove(member)
        pool.failed[member.name] = end
        self.retiring(member.name, True)
        logger.error("%s %s", member.name, end)
        ray.kill(member.handle, no_restart=True)
        self.cpu.release(member.name)

    def failures(self) -> list[str]:
        """One line per worker that failed to start, or died for good, since its pool was
        last scaled."""
        return [line for p in self.pools.values() for line in _lines(p.failed)]

    def replaced(self, role: str) -> list[str]:
        """The `failures` lines that `role`'s last scale took out of the pool's count: those
        from before it, and those it found (`epd scale` waits on them, and stops at others)."""
        return list(self.pools[role].replaced)

    async def survey(self) -> list[str]:
        """`_reap` every pool, then one line per worker Ray has not placed yet whose request
        exceeds what the cluster has free, with both (it waits for resources), and one per
        worker Ray restarts, with how often (a crash loop while it starts was told as
        loading its model for `ready_timeout_s`)."""
        import ray

        states = await self._reap(list(self.pools.values()))
        loop, free = asyncio.get_running_loop(), None
        with contextlib.suppress(TimeoutError):  # nothing is said to wait for resources then
            async with asyncio.timeout(ASK_RAY_S):
                free = await loop.run_in_executor(self._ray_state, ray.available_resources)
        lines = []
        for pool in self.pools.values():
            for m in pool.members:
                unplaced = actor_id(m.handle) in states.unplaced
                if (
                    unplaced
                    and free is not None
                    and any(v > free.get(k, 0.0) for k, v in m.request.items())
                ):
                    asked = {k: v for k, v in m.request.items() if v}  # not a GPU it needs not
                    asks = ", ".join(_amount(k, v) for k, v in asked.items())
                    has = ", ".join(_amount(k, free.get(k, 0.0)) for k in asked)
                    lines.append(f"{m.name} {WAITS_FOR_RAY}: asks {asks}; free: {has}")
                elif restarts := states.restarted.get(actor_id(m.handle)):
                    times = "once" if restarts == 1 else f"{restarts} times"
                    lines.append(f"{m.name} is restarting (restarted {times}: its log says why)")
        return lines

    def _worker_settings(self, role: str, name: str) -> ModelWorkerSettings:
        """The role's settings with this deployment's router and identity filled in (the
        host is filled in by the actor, on its own node)."""
        base = self.role_settings[role]
        changes: dict[str, Any] = {"router_address": self.router_address, "name": name}
        changes["router_addresses"] = self.router_addresses
        if self.use_gpus and base.device == "cpu":
            # Ray gave the actor its GPU(s) through CUDA_VISIBLE_DEVICES: "cuda" is the first.
            changes["device"] = "cuda"
        return dataclasses.replace(base, **changes)

    async def _retire(self, role: str, member: _Member) -> None:
        """Drain one worker (router first, then the worker itself) and end its actor."""
        import ray

        timeout_s = self.settings.drain_timeout_s
        try:
            if member.name not in self.registered:
                # Still starting (loading its model; Ctrl-C during start-up): no work to
                # finish, and describe() would wait for its start-up, holding its CPUs and
                # GPUs. Were it to register meanwhile, it registers retiring (`retiring`).
                return
            if not self.routers_drained:
                await self._drain_at_routers(member, timeout_s)
            # Always the worker's own drain, whatever the routers said: it finishes the
            # streams and leases it holds before the actor is killed.
            async with asyncio.timeout(timeout_s + 5):
                clean = await member.handle.drain.remote(timeout_s)
            logger.info("%s drained (%s)", member.name, "clean" if clean else "timed out")
        except Exception as exc:  # it died retiring (killed, crashed): stopped all the same
            logger.warning(
                "draining %s failed (%s); stopping it anyway", member.name, error_summary(exc)
            )
        finally:
            ray.kill(member.handle, no_restart=True)
            self.cpu.release(member.name)
            logger.info("%s (%s) stopped", member.name, role)

    async def _drain_at_routers(self, member: _Member, timeout_s: float) -> None:
        """Ask every router to stop sending `member` work and wait for what it sent; a router
        that fails (down, or too slow) is logged and does not stop the others."""
        async with asyncio.timeout(timeout_s):
            description = await member.handle.describe.remote()
        routers = [self.router_address, *self.router_addresses]
        outcomes = await asyncio.gather(
            *(
                drain_at_router(r, description.address, timeout_s, self.credentials)
                for r in routers
            ),
            return_exceptions=True,
        )
        for router, outcome in zip(routers, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning("draining %s at router %s failed: %r", member.name, router, outcome)

    async def stop(self, *, routers_drained: bool = False) -> None:
        """Retire every worker and wait for all retirements to finish.

        `routers_drained`: every router is drained (it sends no worker new work; it may
        still answer heartbeats) or stopped, so the drain step at the routers is skipped.
        """
        self.routers_drained = routers_drained
        self.stopping = True  # no scaling up from here
        for task in self._starting:
            task.cancel()
        for role in ROLES:
            await self.scale(role, 0)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
