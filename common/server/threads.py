"""CPU placement of one worker process: its torch threads and the cores it may run on.

Several workers on one node each default to every core (torch's intra-op pool is one thread
per core), so two decode workers on two cores run four busy threads and slow each other down
several times over. `epd serve` gives each worker a `CpuPlacement` (`cluster.placement`
plans it); `python -m <role>` alone takes every core. `apply` runs once, at worker start,
before the model loads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CpuPlacement:
    """What one worker process runs with."""

    threads: int  # torch intra-op threads (>= 1)
    cores: tuple[int, ...] | None = None  # CPU ids it is pinned to (None: not pinned)

    @property
    def interop_threads(self) -> int:
        """torch inter-op threads: few; a worker runs one model step at a time."""
        return max(1, min(self.threads, 2))


def available_cores() -> tuple[int, ...]:
    """The CPU ids this process may run on (all of `os.cpu_count()` where the platform has
    no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def resolve(threads: int, share: CpuPlacement | None = None) -> CpuPlacement:
    """The placement of a worker whose `threads` setting is `threads` (0: auto): the
    planned `share` (under `epd serve`), else every core this process may use."""
    if threads < 0:
        from common.settings.schema import SettingsError

        raise SettingsError("threads: must not be negative")
    if share is not None:
        return share
    return CpuPlacement(threads or len(available_cores()))


def apply(placement: CpuPlacement, name: str = "worker") -> None:
    """Set torch's intra-op and inter-op threads and, when given, this process's CPU
    affinity. The inter-op count can only be set before torch's first parallel work; when
    that already ran, it is left (debug log). Affinity is skipped (debug log) where the
    platform has no `sched_setaffinity` or refuses the set."""
    import torch

    torch.set_num_threads(placement.threads)
    try:
        torch.set_num_interop_threads(placement.interop_threads)
    except RuntimeError:
        logger.debug("%s: torch inter-op threads already fixed; left as they are", name)
    pinned = _pin(placement.cores, name)
    logger.info(
        "%s: %d torch threads%s",
        name,
        placement.threads,
        f", pinned to CPUs {_ranges(placement.cores)}" if pinned and placement.cores else "",
    )


def _pin(cores: Sequence[int] | None, name: str) -> bool:
    if not cores:
        return False
    if not hasattr(os, "sched_setaffinity"):
        logger.debug("%s: no CPU affinity on this platform; not pinned", name)
        return False
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:
        logger.debug("%s: CPU affinity %s refused (%s); not pinned", name, list(cores), exc)
        return False
    return True


def _ranges(cores: Sequence[int]) -> str:
    """ "0-3,8" for (0, 1, 2, 3, 8)."""
    parts: list[str] = []
    start = prev = None
    for core in sorted(cores):
        if prev is not None and core == prev + 1:
            prev = core
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
        start = prev = core
    if start is not None:
        parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)
