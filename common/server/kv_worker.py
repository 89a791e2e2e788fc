"""What the KV workers (prefill and decode) share around their servicers: the running server
that owns their cleanup, router registration, heartbeat load, and calls to peer workers.

Lifecycle of a `WorkerServer`: the role's `serve` starts gRPC, builds the cleanup steps in
the order they must run (registrar first, so the router stops routing here before anything
is torn down), and `adopt`s the started server. `stop` stops gRPC, then runs every step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from common.models.runner import LmRunner
from common.server.registrar import Registrar
from common.server.rpc import PROTOCOL_VERSION, RunningServer, WorkerLifecycle, channel
from epd.v1 import registry_service_pb2

logger = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]


@dataclass(slots=True, eq=False)
class WorkerServer(RunningServer):
    """A worker's running gRPC server plus what must stop with it (see the module docstring).

    `servicer` exposes the worker's counters; `registrar` is None without a router.
    """

    lifecycle: WorkerLifecycle = field(default_factory=WorkerLifecycle)  # drain / state
    servicer: Any = None  # the role servicer (counters, runner)
    registrar: Registrar | None = None  # router registration, when configured
    cleanup: list[Cleanup] = field(default_factory=list)  # run in order after gRPC stops

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stop gRPC (RPCs past `grace_s` are cancelled), then every cleanup step."""
        if self.stopped:
            return
        await RunningServer.stop(self, grace_s)
        for step in self.cleanup:
            try:
                await step()
            except Exception:
                logger.exception("worker cleanup step failed")


def adopt(running: RunningServer, **extra: Any) -> WorkerServer:
    """A `WorkerServer` taking over a started `RunningServer`."""
    return WorkerServer(
        server=running.server,
        health=running.health,
        address=running.address,
        service_names=running.service_names,
        **extra,
    )


def register_kv_worker(
    router_address: str | None,
    *,
    role: registry_service_pb2.WorkerRole,
    address: str,
    runner: LmRunner,
    name: str,
    load: Callable[[], registry_service_pb2.WorkerLoad],
) -> Registrar | None:
    """Start registering a KV worker (its model identity and KV layout) with the router.

    None when no router is configured. The caller stops the returned registrar first on
    shutdown.
    """
    if not router_address:
        return None
    registrar = Registrar(
        router_address,
        registry_service_pb2.WorkerInfo(
            role=role,
            address=address,
            model=runner.identity,
            kv_layout=runner.kv_layout,
            protocol_version=PROTOCOL_VERSION,
            capabilities=["nixl"],
            name=name,
        ),
        load,
    )
    registrar.start()
    return registrar


def kv_load(
    runner: LmRunner, active: int, lifecycle: WorkerLifecycle
) -> registry_service_pb2.WorkerLoad:
    """Heartbeat load of a KV worker: `active` RPCs, KV blocks, prefix-cache hits/lookups."""
    pool = runner.pool
    return registry_service_pb2.WorkerLoad(
        active_requests=active,
        kv_blocks_used=pool.num_used_blocks,
        kv_blocks_free=pool.num_free_blocks,
        cache_hits=pool.hits,
        cache_lookups=pool.lookups,
        draining=lifecycle.draining,
    )


class PeerCalls:
    """Fire-and-forget calls to other workers (lease releases), over channels opened on first
    use and kept per address. `close` waits for the calls in flight, then closes the channels.
    """

    def __init__(self) -> None:
        self._channels: dict[str, Any] = {}  # peer address -> grpc.aio channel
        self._tasks: set[asyncio.Task[None]] = set()  # calls in flight

    def channel(self, address: str) -> Any:
        """The channel to `address`, opened on first use."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        return ch

    def spawn(self, call: Coroutine[Any, Any, None]) -> None:
        """Run `call` in the background; `close` waits for it."""
        task = asyncio.create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait for the calls in flight, then close every channel."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
