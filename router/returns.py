"""Requests wait out the restart of a role's last worker.

When the last worker of a role went (killed, crashed: Ray restarts the actor, Kubernetes
the pod, and it registers again under its name), every request failed at once until it was
back: 91 requests in the 16 s one decode worker took, though `request_timeout_s` was 300 s.
Now a request that finds no worker of a role it needs that it could use (none registered
and serving, or each one gone: a call on it lost its connection, or failed and its
heartbeats stopped) waits for one, provided a worker of that role was lost within
`RESTART_WINDOW_S` (dropped for silence, not drained) or is gone now. It waits until a
worker registers (looking again every `CHECK_S` for a heartbeat that clears a mark), for at
most `max_queue_wait_s`, and never within `DEADLINE_MARGIN_S` of its
deadline (a client with a short one still gets UNAVAILABLE, which it may take to another
router, not DEADLINE_EXCEEDED); at most `max_waiting` requests wait at once, and none while
the router drains. Then it goes on as before: served, or refused UNAVAILABLE naming the
role. A role that never had a worker, or lost its last one longer ago, is not restarting:
its requests fail at once, as before; except in a router's first `STARTUP_S`, when its
workers (restarted with it, or still registered with the process it replaced) are still to
register. Every request waits for prefill and decode (a one-token answer for prefill
alone: `kv_roles`), and one with media items for an encoder as well (before, every image
request failed at once through an encoder's 5 s restart), before admission: a waiting
request holds no KV reservation. One whose items the caches hold waits for the encoder
too (whether it needs one is known only once a prefill worker is chosen); only while no
encoder is left. Requests already running on the worker that died are not held (their
calls fail; a decode stream resumes where another is).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from common.roles import Role
from router.admission_need import kv_roles
from router.registry import Registry

if TYPE_CHECKING:
    from router.calls import Job, WorkerCalls
from router.workers import WorkerRecord

RESTART_WINDOW_S = 120.0  # a role that lost its last worker this recently is restarting
# A router this new counts every role without a worker as restarting: a restarted router
# answered before its workers registered again (within a second), and refused those requests.
STARTUP_S = 2.0
CHECK_S = 0.5  # how often waiting requests look again without news (a heartbeat clears a mark)
DEADLINE_MARGIN_S = 1.0  # a request stops waiting this long before its deadline
SILENT_HEARTBEATS = 2  # a suspect worker silent for this many intervals: gone, not wedged


def needed(job: Job) -> tuple[Role, ...]:
    """The roles `job` waits for: prefill, decode unless its answer is one token
    (`kv_roles`), and an encoder if it has media items."""
    kv = kv_roles(job.sampling.max_tokens)
    return (*kv, Role.ENCODER) if job.prompt.params.items else kv


class Returns:
    """Who is restarting, and the wait for them (module docstring)."""

    def __init__(
        self,
        max_wait_s: float,
        registry: Registry | None = None,
        max_waiting: int = 512,
        stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.max_wait_s = max_wait_s
        self.stop = stop  # no request waits once this says so (the router drains)
        self.max_waiting = max_waiting  # requests waiting at once, at most
        # role -> name of each worker lost in the last `RESTART_WINDOW_S` -> registry time
        self.lost: dict[Role, dict[str, float]] = {}
        self.waited = 0  # requests that waited for a worker, ever
        self.waiting = 0  # requests waiting now
        self.registry: Registry | None = None
        self.started = -STARTUP_S  # registry time `follow` began (none: long ago)
        self._arrived = asyncio.Event()  # set when a worker registers (then a new one)
        if registry is not None:
            self.follow(registry)

    def follow(self, registry: Registry, calls: WorkerCalls | None = None) -> None:
        """Watch `registry`'s workers (none watched: no role is restarting), from now: the
        router's start (`STARTUP_S`); `calls` then wait through this for a worker back from a
        restart (`WorkerCalls.pick_or_return`)."""
        self.registry = registry
        if calls is not None:
            calls.returns = self
        self.started = registry.clock()
        registry.on_expire.append(self._lost)
        registry.on_register.append(self._arrival)

    def _arrival(self, record: WorkerRecord) -> None:
        """A worker registered: wake every waiter; later ones wait for the next. The loss of
        its name is over (back from its restart): were its role emptied on purpose later (a
        scale to 0), requests must not wait for that return (each waited `max_wait_s`:
        raypools review, s39); another's registration ends no loss (ownfixH)."""
        self._arrived.set()
        self._arrived = asyncio.Event()
        self.lost.get(record.role, {}).pop(record.name, None)

    def _lost(self, record: WorkerRecord) -> None:
        if record.draining or self.registry is None:  # a drained one left on purpose
            return
        now = self.registry.clock()
        lost = self.lost.setdefault(record.role, {})
        for name in [n for n, when in lost.items() if now - when >= RESTART_WINDOW_S]:
            del lost[name]  # long ago: not coming back (and names do not pile up)
        lost[record.name] = now

    def restarting(self, role: Role) -> bool:
        """Whether `role` has no worker a request could use, and lost one lately (one silent
        past the timeout counts as lost before the expiry pass drops it: in between, waiting
        requests were let go to fail UNAVAILABLE, and new ones failed at once; one that
        could not be connected to, at once: for two heartbeats after a kill, requests
        failed at once)."""
        registry = self.registry
        if registry is None:
            return False
        now, silent_s = registry.clock(), SILENT_HEARTBEATS * registry.heartbeat_interval_s

        def gone(w: WorkerRecord) -> bool:
            silent = now - w.last_seen
            timed_out = silent > registry.worker_timeout_s
            return timed_out or w.unreachable or (w.suspect and silent > silent_s)

        workers = [w for w in registry.workers(role, timed_out=True) if not w.draining]
        if not all(map(gone, workers)):
            return False
        left = max(self.lost.get(role, {}).values(), default=None)
        lately = left is not None and now - left < RESTART_WINDOW_S
        return lately or bool(workers) or now - self.started < STARTUP_S

    @property
    def full(self) -> bool:
        """`max_waiting` requests wait already: another does not."""
        return self.waiting >= self.max_waiting

    async def wait(
        self, roles: Iterable[Role], deadline: float, stop: Callable[[], bool] | None = None
    ) -> None:
        """Return once none of `roles` is restarting, `DEADLINE_MARGIN_S` before `deadline`
        (time.monotonic), `max_wait_s` from now, or once `stop()` (default `self.stop`: the
        router drains), whichever comes first; at once when `max_waiting` requests wait
        already."""
        needed = tuple(roles)
        stop = stop or self.stop
        if not any(map(self.restarting, needed)) or self.full:
            return
        self.waited += 1
        self.waiting += 1
        until = min(deadline - DEADLINE_MARGIN_S, time.monotonic() + self.max_wait_s)
        try:
            while not stop() and any(map(self.restarting, needed)):
                left = until - time.monotonic()
                if left <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, CHECK_S)):
                        await self._arrived.wait()
        finally:
            self.waiting -= 1
