"""One worker of a pool: the Ray actor that runs its role's gRPC server (`WorkerActor`),
and the node-address helpers the controller shares with it. `cluster.pools` creates and
retires these actors; the module docstring there tells their lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from cluster import logs
from common.server.role import RoleServer, freeze_startup_heap
from common.server.threads import CpuPlacement, apply, resolve
from common.settings.base import WorkerSettings

logger = logging.getLogger(__name__)

# The module whose `serve(settings)` runs each role's server.
SERVER_MODULES = {
    "router": "router.server",
    "encoder": "encoder_worker.server",
    "prefill": "prefill_worker.server",
    "decode": "decode_worker.server",
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_ANY = ("0.0.0.0", "::", "")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger().setLevel(level.upper())
    logs.worker_env(level)  # NIXL's INFO lines only at debug


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
    failing: tuple[str, ...] = ()  # "router: failure" per router its calls last failed on


class WorkerActor:
    """One worker of a pool: the role's gRPC server, running in this actor's event loop.

    Made into a Ray actor by `PoolManager` (`ray.remote(WorkerActor).options(...)`). The
    async `__init__` runs again on every Ray restart, so a restarted worker serves and
    registers again without help from the pool.
    """

    # Ray runs an async actor's async __init__ in the actor's event loop (and again on restart).
    async def __init__(  # type: ignore[misc]
        self,
        role: str,
        name: str,
        settings: WorkerSettings,
        log_level: str,
        host: str | None = None,
        placement: CpuPlacement | None = None,
    ) -> None:
        self.role = role
        self.name = name
        setup_logging(log_level)
        # Threads and cores first: torch's pools are sized before the model loads.
        apply(resolve(getattr(settings, "threads", 0), placement), name)
        # The listen (and registered) host is resolved here, on the node Ray placed us on:
        # None or a wildcard means this node's IP.
        if host is None or host in _ANY:
            host = _node_ip()
        settings = dataclasses.replace(settings, host=host)
        module = importlib.import_module(SERVER_MODULES[role])
        logger.info("%s: starting %s server", name, role)
        self.server: RoleServer[Any] = await module.serve(settings)
        freeze_startup_heap()
        logger.info("%s: %s server on %s", name, role, self.server.address)

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this: "(epd-prefill-1 pid=...)".
        return str(getattr(self, "name", "epd-worker"))

    async def describe(self) -> WorkerDescription:
        """Role, name, address, pid and registration failures of this worker."""
        registrar = self.server.registrar
        failing = tuple(registrar.failing()) if registrar is not None else ()
        return WorkerDescription(self.role, self.name, self.server.address, os.getpid(), failing)

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
        clean = await self.server.drain(max(0.0, deadline - time.monotonic())) and clean
        logger.info("%s: drained (%s) and stopped", self.name, "clean" if clean else "timed out")
        return clean

    async def _wait_leases(self, deadline: float) -> bool:
        """Wait until the server holds no leases for peers; False at the deadline. Workers
        without leases (decode) return at once."""
        while self.server.outstanding_leases() > 0:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True
