"""Admission control: a request starts only when the KV blocks it needs are free on the
workers it will use; otherwise it waits in a bounded FIFO queue, and past the queue it is
refused with RESOURCE_EXHAUSTED naming the limit and how long to back off.

Need (`router.admission_need`): the KV blocks a request holds on each KV role's worker; one
that can never fit is refused at once with `TooLarge` (`Need.too_large`): waiting cannot help.

Ledger: heartbeats lag, so the router keeps its own reservations per worker. A worker's room
is its capacity (`kv_blocks_used + kv_blocks_free` of its last heartbeat: the pool size,
evictable cached blocks counting as free) minus the blocks this router has reserved on it.
A worker that has not heartbeated its capacity yet is not accounted (its own refusals, see
the safety net, still protect it). With several routers each keeps its own ledger; the
decode worker's own wait for blocks and the safety net cover what the others hold.

Queue: one FIFO. A request is placed at once when nobody waits and each KV role has a worker
with room; else it joins the tail, or is refused when `max_queued` already wait. Only the
head is placed (with `tenant_share`, the first not over its tenant's share: see
`router.admission_tenants`): each role's worker is picked by the caller's `choose(role,
exclude)` among those with room (`exclude`: the rest) and reserved, then the next head is
tried. The head wakes when a reservation is released and polls every `poll_s`; a waiter
woken that is no longer the head (a worker's capacity changed the order) wakes the one that
is. A request waits at most `max_wait_s` in all (refused past that) and never past its
deadline (DEADLINE_EXCEEDED); a cancelled waiter leaves at once. A waiter holds nothing.
With no live worker of a KV role it needs (`Need.roles`: not decode for one token), the head
ends with UNAVAILABLE, and each next head in turn; releasing and moving never fail for it.

Safety net: a prefill worker's RESOURCE_EXHAUSTED (its pool momentarily full of blocks the
ledger does not see: another router's requests, a worker not yet heartbeated, leases the
reaper has not yet expired) comes back as `KvPoolFull`; the caller hands the ticket to
`requeue`, which releases its reservations and puts it back at the head: placed at once on
a prefill worker that has not refused it, if one has room, else after a back-off (doubling
from `retry_backoff_s`, at most 1 s) on any: the ledger cannot see what fills the pool that
refused, so only another worker or time can help.

Back-off hint: the median wait of the last requests that queued (1 s before any), at least
0.1 s and at most `max_wait_s`; in the message and as trailing metadata `retry-after-ms`.

Counters (Status and metrics): `admitted`, `refused` by reason, `requeued`, `placed_ahead`,
`expired`, `cancelled`, `peak`, and the waits of the last `WAIT_WINDOW` admissions.

Plain in-process state driven from one asyncio loop, like the registry; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc

from common.roles import KV_ROLES, Role
from router.admission_need import Need
from router.admission_tenants import TenantShares
from router.calls import Refused, RouterError
from router.registry import Registry
from router.workers import NoWorkerError, WorkerRecord

logger = logging.getLogger(__name__)

WAIT_WINDOW = 1000  # admissions whose waits Status summarises
MIN_RETRY_AFTER_S = 0.1  # smallest back-off hint
MAX_RETRY_BACKOFF_S = 1.0  # longest pause before a requeued request is placed again

# choose(role, exclude) -> a live, non-draining worker of `role` whose address is not in
# `exclude` (the workers without room), e.g. `Registry.pick`.
Choose = Callable[[Role, frozenset[str]], WorkerRecord]


@dataclass(slots=True, eq=False)
class Ticket:
    """An admitted request's reservations; `Admission.release` them (idempotent)."""

    need: Need  # blocks per role
    deadline: float  # the request's `time.monotonic()` deadline
    tenant: str | None = None  # whose request (its share of the queue)
    workers: dict[Role, WorkerRecord] = field(default_factory=dict)  # reserved on, per role
    waited_s: float = 0.0  # time queued, requeues included
    requeues: int = 0  # times put back after a prefill worker's RESOURCE_EXHAUSTED
    refused_by: set[str] = field(default_factory=set)  # the prefill workers that did


@dataclass(slots=True, eq=False)
class _Waiter:
    ticket: Ticket  # what it will hold once placed
    choose: Choose  # the caller's worker choice
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set: try again now
    not_before: float = 0.0  # clock time before which it is not placed (requeue back-off)


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """A snapshot for `AdminService.Status` (see the module docstring)."""

    queued: int  # waiting now
    peak: int  # most waiting at once since start
    admitted: int  # admitted since start
    refused: int  # refused since start (queue full, waited too long, never fits)
    requeued: int  # put back after a prefill worker's RESOURCE_EXHAUSTED
    wait_p50_s: float  # median wait of the last WAIT_WINDOW admissions (0 before any)
    wait_max_s: float  # longest of them


class Admission:
    """Reservations per worker and the FIFO of waiting requests; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        *,
        max_queued: int,
        max_wait_s: float,
        poll_s: float = 0.1,
        retry_backoff_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        tenant_share: float = 1.0,
    ) -> None:
        self.registry = registry
        self.max_queued = max_queued  # most requests waiting at once
        self.tenants = TenantShares(tenant_share, max_queued)  # places and blocks per tenant
        self.max_wait_s = max_wait_s  # longest a request waits in all
        self.poll_s = poll_s  # the head re-checks this often without a release
        self.retry_backoff_s = retry_backoff_s  # first pause of a requeued request
        self._clock = clock
        self._reserved: Counter[str] = Counter()  # blocks reserved per worker address
        self._queue: deque[_Waiter] = deque()
        self._waits: deque[float] = deque(maxlen=WAIT_WINDOW)  # seconds, per admission
        self.admitted = 0  # counters (metrics) from here on
        self.refused: Counter[str] = Counter()  # "queue_full", "queue_wait", "never_fits"
        self.requeued = 0
        self.placed_ahead = 0  # placed before an earlier waiter over its tenant's share
        self.expired = 0  # deadline passed while queued
        self.cancelled = 0  # caller went away while queued
        self.peak = 0

    # ----------------------------------------------------------------------- ledger

    def capacity(self, worker: WorkerRecord) -> int | None:
        """The worker's KV blocks in all, from its last heartbeat (None before one)."""
        total = worker.load.kv_blocks_used + worker.load.kv_blocks_free
        return total or None

    def reserved(self, address: str) -> int:
        """Blocks this router has reserved on the worker at `address`."""
        return self._reserved[address]

    def has_room(self, worker: WorkerRecord, blocks: int) -> bool:
        """Whether `blocks` more fit beside this router's reservations (True: unknown)."""
        cap = self.capacity(worker)
        return cap is None or cap - self._reserved[worker.address] >= blocks

    def release(self, ticket: Ticket, role: Role | None = None) -> None:
        """Give back the ticket's reservation for `role` (None: every role); idempotent."""
        roles = [role] if role is not None else list(ticket.workers)
        released = False
        for r in roles:
            worker = ticket.workers.pop(r, None)
            if worker is not None:
                self._unreserve(worker, ticket.need.blocks(r))
                self.tenants.give(ticket.tenant, r, ticket.need.blocks(r))
                released = True
        if released:
            self._kick()

    def move(self, ticket: Ticket, role: Role, worker: WorkerRecord) -> None:
        """The stage of `role` runs on `worker` after all (a retry): move the reservation,
        unchecked (the blocks are needed wherever the stage runs)."""
        old = ticket.workers.get(role)
        if old is None or old.address == worker.address:
            return
        self._unreserve(old, ticket.need.blocks(role))
        self._reserve(worker, ticket.need.blocks(role))
        ticket.workers[role] = worker
        self._kick()

    def _reserve(self, worker: WorkerRecord, blocks: int) -> None:
        """One request's `blocks` on `worker`, its load from now on (`placed`)."""
        worker.placed += 1
        self._reserved[worker.address] += blocks

    def _unreserve(self, worker: WorkerRecord, blocks: int) -> None:
        worker.placed -= 1
        self._reserved[worker.address] -= blocks
        if self._reserved[worker.address] <= 0:
            del self._reserved[worker.address]

    # ------------------------------------------------------------------------ queue

    async def admit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        deadline: float,
        choose: Choose,
        tenant: str | None = None,
        prompt_field: str = "messages",
        default_length: bool = False,
    ) -> Ticket:
        """Reserve the request's blocks on a worker of each KV role it needs, waiting in the
        queue when needed. Raises RouterError: UNAVAILABLE (no worker of a role),
        RESOURCE_EXHAUSTED (never fits: `Need.too_large`; `Refused` past the queue, or past
        `tenant`'s share of it), DEADLINE_EXCEEDED (while queued)."""
        self._live(Role.PREFILL)
        layout = self.registry.reference_layout  # set by the first KV worker to register
        assert layout is not None
        need = Need(prompt_tokens, max_tokens, layout.block_size, prompt_field, default_length)
        ticket = Ticket(need, deadline, tenant)
        self._check_fits(ticket.need)
        if not self._queue and self._place(ticket, choose):
            self._admitted(ticket)
            return ticket
        everyone = len(self._queue) >= self.max_queued
        if everyone or self.tenants.queue_full(tenant):
            self.refused["queue_full"] += 1
            whose, share = ("", "") if everyone else (" for this tenant", "its tenant_share of ")
            waiting = len(self._queue) if everyone else self.tenants.queued(tenant)
            raise Refused(
                f"admission queue full{whose}: {waiting} requests already wait for KV blocks "
                f"({share}max_queued_requests={self.max_queued})",
                self.retry_after_s(),
            )
        await self._wait(_Waiter(ticket, choose))
        self._admitted(ticket)
        return ticket

    async def requeue(self, ticket: Ticket, choose: Choose, refused: str = "") -> None:
        """The prefill worker at `refused` refused the ticket's prompt for a full pool:
        release its reservations and place it again from the head of the queue, at once on
        a prefill worker that has not refused it, else after a back-off (the pool that
        refused may have room by then). Raises like `admit`'s wait."""
        reserved = ticket.workers.get(Role.PREFILL)
        refused = refused or (reserved.address if reserved is not None else "")
        if refused:
            ticket.refused_by.add(refused)
        self.release(ticket)
        self._check_fits(ticket.need)  # a capacity heartbeated since may rule it out
        ticket.requeues += 1
        self.requeued += 1
        backoff = min(MAX_RETRY_BACKOFF_S, self.retry_backoff_s * 2 ** (ticket.requeues - 1))
        await self._wait(_Waiter(ticket, choose, not_before=self._clock() + backoff), front=True)

    def retry_after_s(self) -> float:
        """The back-off hint (see the module docstring)."""
        queued = [w for w in self._waits if w > 0]
        hint = statistics.median(queued) if queued else 1.0
        return min(max(hint, MIN_RETRY_AFTER_S), max(self.max_wait_s, MIN_RETRY_AFTER_S))

    def stats(self) -> AdmissionStats:
        """Queue depth, totals and recent waits."""
        waits = sorted(self._waits)
        return AdmissionStats(
            queued=len(self._queue),
            peak=self.peak,
            admitted=self.admitted,
            refused=sum(self.refused.values()),
            requeued=self.requeued,
            wait_p50_s=statistics.median(waits) if waits else 0.0,
            wait_max_s=waits[-1] if waits else 0.0,
        )

    def _live(self, role: Role, *, required: bool = True) -> list[WorkerRecord]:
        """`role`'s live, non-draining workers; none: UNAVAILABLE where `required`."""
        workers = self.registry.workers(role)
        live = [w for w in workers if not w.draining]
        if required and not live:
            refusal = NoWorkerError(role, self.registry.refusals.of(str(role)), workers)
            raise RouterError(grpc.StatusCode.UNAVAILABLE, str(refusal))
        return live

    def _check_fits(self, need: Need) -> None:
        for role in need.roles:  # raised as made: bound to a local here, the refusal closed a
            capacities = [self.capacity(w) for w in self._live(role)]  # cycle through this
            if need.too_large(role, capacities) is not None:  # frame, which kept the request
                self.refused["never_fits"] += 1  # until a garbage collection (ownfixC C3)
                raise need.too_large(role, capacities) or AssertionError

    def _place(self, ticket: Ticket, choose: Choose, avoid: Collection[str] = frozenset()) -> bool:
        """Reserve on a worker with room for each role, none of the prefill workers in
        `avoid`, or nothing and False."""
        full: dict[Role, frozenset[str]] = {}
        for role in ticket.need.roles:
            live = self._live(role)
            blocks = ticket.need.blocks(role)
            full[role] = frozenset(w.address for w in live if not self.has_room(w, blocks))
            if role == Role.PREFILL:
                full[role] |= {w.address for w in live if w.address in avoid}
            if len(full[role]) == len(live):
                return False
        chosen: dict[Role, WorkerRecord] = {}
        for role in ticket.need.roles:  # every role's worker before any reservation
            try:
                chosen[role] = choose(role, full[role])
            except NoWorkerError:  # gone since `_live` (its heartbeats just ran out)
                return False
        for role, worker in chosen.items():
            self._reserve(worker, ticket.need.blocks(role))
            self.tenants.take(ticket.tenant, role, ticket.need.blocks(role))
            ticket.workers[role] = worker
        return True

    def _over_share(
        self, ticket: Ticket, capacity: Callable[[Role], int | None] | None = None
    ) -> Role | None:
        """The first KV role on which the ticket would pass its tenant's share while other
        tenants wait, if any (`capacity`: each role's, when the caller has it)."""
        return self.tenants.over(ticket.tenant, ticket.need.blocks, capacity or self._role_capacity)

    def _role_capacity(self, role: Role) -> int | None:
        """KV blocks of `role`'s live workers in all (None: one has not heartbeated, or there
        is none: no share applies, and the head's `_place` says UNAVAILABLE). Never raises,
        as `_kick` (from `release`, `move`, a leaving waiter) relies on it."""
        capacities = [self.capacity(w) for w in self._live(role, required=False)]
        return None if not capacities or None in capacities else sum(c or 0 for c in capacities)

    def _head(self) -> _Waiter | None:
        """The waiter placed next: the first not over its tenant's KV share (those over it
        wait without holding up the rest), else the first."""
        if not self._queue:
            return None
        if self.tenants.share is not None:
            capacity = {role: self._role_capacity(role) for role in KV_ROLES}.__getitem__
            for waiter in self._queue:
                if self._over_share(waiter.ticket, capacity) is None:
                    return waiter
        return self._queue[0]

    async def _wait(self, waiter: _Waiter, *, front: bool = False) -> None:
        """Queue `waiter` until it is placed; it leaves the queue however this ends."""
        ticket = waiter.ticket
        if front:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
        self.peak = max(self.peak, len(self._queue))
        self.tenants.enter(ticket.tenant)
        start = self._clock()
        limit = start + max(0.0, self.max_wait_s - ticket.waited_s)
        try:
            while True:
                now = self._clock()
                head = self._head() is waiter
                avoid = ticket.refused_by if now < waiter.not_before else frozenset()
                early = not avoid and now < waiter.not_before  # nothing to avoid: back off
                if head and not early and self._place(ticket, waiter.choose, avoid):
                    self.placed_ahead += self._queue[0] is not waiter
                    return
                if not head:
                    self._kick()  # the head changed unkicked (a worker's capacity): pass it on
                if now >= ticket.deadline:
                    self.expired += 1
                    raise RouterError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"deadline passed while queued for KV blocks ({now - start:.1f} s)",
                    )
                if now >= limit:
                    self.refused["queue_wait"] += 1
                    waited = ticket.waited_s + now - start
                    over = self._over_share(ticket)
                    held = (
                        "no KV blocks free"
                        if over is None
                        else f"this tenant at its tenant_share of the {over} workers' KV blocks"
                    )
                    raise Refused(
                        f"{held} for {waited:.1f} s in the admission queue "
                        f"(max_queue_wait_s={self.max_wait_s:g})",
                        self.retry_after_s(),
                    )
                timeout = min(ticket.deadline, limit) - now
                if head:
                    timeout = min(timeout, max(waiter.not_before - now, self.poll_s))
                waiter.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await waiter.wake.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            ticket.waited_s += self._clock() - start
            self.tenants.leave(ticket.tenant)
            self._queue.remove(waiter)
            self._kick()  # the next head (with shares, placing one may make another it)

    def _kick(self) -> None:
        """Wake the head of the queue: something it waits for may have changed."""
        head = self._head()
        if head is not None:
            head.wake.set()

    def _admitted(self, ticket: Ticket) -> None:
        self.admitted += 1
        self._waits.append(ticket.waited_s)
        if ticket.waited_s > 0:
            logger.debug("admitted after %.3f s in the queue", ticket.waited_s)
