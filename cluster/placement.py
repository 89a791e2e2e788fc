"""CPU plan of the worker actors `epd serve` starts: torch threads, Ray's CPU request and a
core set per worker, so workers sharing a node do not each take every core.

- threads: a role's `threads` setting, or (0, auto) the node's cores divided among the
  workers `epd serve` places on a node (the starting workers over the alive nodes, rounded
  up), at least 1.
- cores: on a one-node cluster (the controller's node is every worker's node) with at least
  a core per starting worker, each worker is pinned to `threads` cores no other live worker
  holds, lowest ids first. An auto worker that finds fewer free (scaled past the plan) takes
  the free ones it finds (that many threads); finding none, it shares the node: 1 thread,
  not pinned. An explicit `threads` that does not fit is not pinned. With more starting
  workers than cores no worker is pinned (the kernel balances them better than a fixed
  split of too few cores), nor on several nodes, where Ray decides where a worker lands.
- Ray's `num_cpus` for the actor: `[pools] num_cpus` when set; else its threads, except for
  an auto worker that shares its node (scaled past the cores, or more workers than cores),
  which asks for none: the node's CPUs are all spoken for, and Ray would not place it.

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
    pin: bool  # pin workers to disjoint cores (one node, a core per starting worker)
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
        pin = nodes == 1 and per_node <= len(node_cores)
        return cls(node_cores, per_node, pin=pin, num_cpus=num_cpus)

    @property
    def share(self) -> float:
        """CPUs per worker on a node: its cores over the workers placed there."""
        return len(self.node_cores) / self.workers_per_node

    def take(self, worker: str, threads: int) -> tuple[CpuPlacement, float]:
        """The placement of `worker` (its role's `threads` setting; 0: auto) and the CPUs
        its actor asks Ray for. Its cores are held until `release(worker)`."""
        auto = threads == 0
        wanted = max(1, int(self.share)) if auto else threads
        cores: tuple[int, ...] | None = None
        if self.pin:
            free = self._free_cores()
            if len(free) >= wanted:
                cores = free[:wanted]
            elif auto and free:
                cores = free  # scaled past the plan: the free cores left
            else:
                logger.debug("%s: fewer than %d free cores; not pinned", worker, wanted)
        if cores:
            self._held[worker] = cores
        shares_node = auto and cores is None and (self.pin or self.share < 1)
        placement = CpuPlacement(len(cores) if cores else (1 if shares_node else wanted), cores)
        if self.num_cpus is not None:
            return placement, self.num_cpus
        return placement, 0.0 if shares_node else float(placement.threads)

    def release(self, worker: str) -> None:
        """`worker` retired: its cores are free for the next worker."""
        self._held.pop(worker, None)

    def _free_cores(self) -> tuple[int, ...]:
        """The cores no live worker holds, lowest first."""
        taken = {core for cores in self._held.values() for core in cores}
        return tuple(core for core in self.node_cores if core not in taken)
