"""CPU plan of the worker actors `epd serve` starts: torch threads, Ray's CPU request and a
core set per worker, so workers sharing a node do not each take every core.

- threads: a role's `threads` setting, or (0, auto) the node's cores divided among the
  workers `epd serve` places on a node (the starting workers over the alive nodes, rounded
  up), at least 1.
- Ray's `num_cpus` for the actor: `[pools] num_cpus` when set; else `threads` when the
  worker's threads are explicit or each auto worker has at least a whole core; else (more
  workers than cores) the fractional share, so that every starting worker still fits.
- cores: on a one-node cluster (the controller's node is every worker's node) each worker is
  pinned to `threads` cores no other live worker holds, lowest ids first; when too few are
  free (scaled past the plan, or threads set above the share), it is not pinned. On several
  nodes Ray decides where a worker lands, so no worker is pinned.

`pending_actor_names` tells which actors still wait for Ray to place them.

`CpuPlanner` is plain state of the pool manager (one asyncio loop); `take` when a worker is
created, `release` when it is retired.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from common.server.threads import CpuPlacement

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CpuPlanner:
    """Hands out `CpuPlacement`s and Ray CPU requests for the workers of one deployment."""

    node_cores: tuple[int, ...]  # CPU ids of a node (the controller's, or the smallest one)
    workers_per_node: int  # workers `epd serve` starts on each node
    pin: bool  # pin workers to disjoint cores (one-node clusters)
    num_cpus: float | None = None  # `[pools] num_cpus`: Ray's CPU request, when set
    _held: dict[str, tuple[int, ...]] = field(default_factory=dict)  # worker -> its cores

    @classmethod
    def for_cluster(
        cls,
        node_cores: tuple[int, ...],
        nodes: int,
        workers: int,
        num_cpus: float | None = None,
    ) -> CpuPlanner:
        """The plan for `workers` starting workers over `nodes` alive nodes of
        `len(node_cores)` CPUs each."""
        per_node = max(1, math.ceil(workers / max(1, nodes)))
        return cls(node_cores, per_node, pin=nodes == 1, num_cpus=num_cpus)

    @property
    def share(self) -> float:
        """CPUs per worker on a node: its cores over the workers placed there."""
        return len(self.node_cores) / self.workers_per_node

    def take(self, worker: str, threads: int) -> tuple[CpuPlacement, float]:
        """The placement of `worker` (its role's `threads` setting; 0: auto) and the CPUs
        its actor asks Ray for. Its cores are held until `release(worker)`."""
        auto = threads == 0
        threads = max(1, int(self.share)) if auto else threads
        if self.num_cpus is not None:
            request = self.num_cpus
        elif auto and self.share < 1:
            request = math.floor(self.share * 100) / 100  # e.g. 3 workers on 2 cores: 0.66
        else:
            request = float(threads)
        cores = self._free_cores(threads) if self.pin else None
        if cores is None and self.pin:
            logger.debug("%s: fewer than %d free cores; not pinned", worker, threads)
        if cores is not None:
            self._held[worker] = cores
        return CpuPlacement(threads, cores), request

    def release(self, worker: str) -> None:
        """`worker` retired: its cores are free for the next worker."""
        self._held.pop(worker, None)

    def _free_cores(self, n: int) -> tuple[int, ...] | None:
        taken = {core for cores in self._held.values() for core in cores}
        free = [core for core in self.node_cores if core not in taken]
        return tuple(free[:n]) if len(free) >= n else None


def pending_actor_names() -> set[str]:
    """Names of the actors Ray has not placed yet (the GCS actor table, which needs no
    dashboard; empty when this Ray does not answer)."""
    try:
        from ray._private.state import actors

        table = actors(actor_state_name="PENDING_CREATION")
    except Exception:
        logger.debug("Ray's actor table did not answer", exc_info=True)
        return set()
    return {str(info.get("Name", "")) for info in table.values()}
