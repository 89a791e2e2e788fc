"""Requests wait out the restart of a role's last worker.

When the last worker of a role went (killed, crashed: Ray restarts the actor, Kubernetes
the pod, and it registers again under its name), every request failed at once until it was
back: 91 requests in the 16 s one decode worker took, though `request_timeout_s` was 300 s.
Now a request that finds no worker of a role it needs that it could use (none registered
and serving, or each one suspect and silent: a call failed on it and its heartbeats
stopped) waits for one, polling, for at most `max_queue_wait_s` and its deadline, provided
a worker of that role was lost within `RESTART_WINDOW_S` (dropped for silence, not drained)
or is suspect and silent now. Then it goes on as before: served, or refused UNAVAILABLE
naming the role. A role that never had a worker, or lost its last one longer ago, is not
restarting: its requests fail at once, as before. Requests already running on the worker
that died are not held (their calls fail; a decode stream resumes where another is).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from common.roles import Role
from router.registry import Registry
from router.workers import WorkerRecord

RESTART_WINDOW_S = 120.0  # a role that lost its last worker this recently is restarting
POLL_S = 0.05  # how often a waiting request looks again
SILENT_HEARTBEATS = 2  # a suspect worker silent for this many intervals: gone, not wedged


class Returns:
    """Who is restarting, and the wait for them (module docstring)."""

    def __init__(self, max_wait_s: float, registry: Registry | None = None) -> None:
        self.max_wait_s = max_wait_s
        self.lost: dict[Role, float] = {}  # role -> registry time its last loss
        self.waited = 0  # requests that waited for a worker, ever
        self.registry: Registry | None = None
        if registry is not None:
            self.follow(registry)

    def follow(self, registry: Registry) -> None:
        """Watch `registry`'s workers (none watched: no role is restarting)."""
        self.registry = registry
        registry.on_expire.append(self._lost)

    def _lost(self, record: WorkerRecord) -> None:
        if not record.draining and self.registry is not None:  # a drained one left on purpose
            self.lost[record.role] = self.registry.clock()

    def restarting(self, role: Role) -> bool:
        """Whether `role` has no worker a request could use, and lost one lately."""
        registry = self.registry
        if registry is None:
            return False
        now, silent_s = registry.clock(), SILENT_HEARTBEATS * registry.heartbeat_interval_s
        workers = [w for w in registry.workers(role) if not w.draining]
        if any(not (w.suspect and now - w.last_seen > silent_s) for w in workers):
            return False
        left = self.lost.get(role)
        return (left is not None and now - left < RESTART_WINDOW_S) or bool(workers)

    async def wait(self, roles: Iterable[Role], deadline: float) -> None:
        """Return once none of `roles` is restarting, or at `deadline` (time.monotonic) or
        `max_wait_s` from now, whichever comes first."""
        needed = tuple(roles)
        if not any(map(self.restarting, needed)):
            return
        self.waited += 1
        until = min(deadline, time.monotonic() + self.max_wait_s)
        while time.monotonic() < until and any(map(self.restarting, needed)):
            await asyncio.sleep(POLL_S)
