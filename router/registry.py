"""The worker registry: who is serving, whether they fit together, and who gets the next job.

Lifecycle of a worker as the router sees it:

    Register  -> checked against the deployment (protocol, model, KV layout); refused with
                 FAILED_PRECONDITION on a mismatch, else recorded under a fresh worker id
                 (a worker re-registering from the same address replaces its old record,
                 refused while a live worker of another role holds the address;
                 when its `instance_id` differs, the process restarted: the `on_restart`
                 listeners hear of the old record first, so its channel, KV-event
                 subscription and prefix entries are dropped, not carried over; a worker
                 of the same name and role at another address replaces the old record
                 too, which the `on_expire` listeners hear of: a restarted Ray actor's
                 new port)
    Heartbeat -> refreshes liveness and load; an unknown id answers known=False so the
                 worker registers again
    draining  -> reported by the worker, asked for through AdminService.Drain, or a
                 retirement (`retire`, the deployment's scale-down); the last two are held
                 under the worker's name while it registers again, restarted or not
                 (`router.drains`); a draining worker gets no new work; Undrain undoes an
                 asked-for drain (not one it reports, nor a retirement)
    expiry    -> a worker silent for longer than the timeout is hidden from `workers` and
                 `pick` at once; `expire` (the router's expiry loop) drops it and tells the
                 `on_expire` listeners, so whatever follows the worker is let go exactly once
                 (as does a registration of the same name elsewhere, see Register); a stall
                 of the router's own loop is not the workers' silence (`excuse`)

Compatibility: every worker must speak `PROTOCOL_VERSION`, serve the expected model identity
(given, or adopted from the first worker to register) and compute in one dtype (the first
said, `check_dtype`). Prefill and decode workers exchange KV blocks, so their `KvLayout`s
must agree field by field with the first one's, and with the checkpoint's layers, KV heads
and head dim when the router has it. What is adopted is kept for the router's life.

Selection picks, among live non-draining workers of a role, the one with the smallest load
estimate (see `WorkerRecord.load_estimate`); ties go to the worker picked least recently.
An optional affinity (cached prefix blocks, for prefill) wins among workers whose load is
within a small slack of the least loaded. A key (an item's content hash, for encoders) gives
each key a home worker by rendezvous (highest-random-weight) hashing over worker names: the
home is the candidate with the highest `rendezvous_weight(key, name)`, so when a worker
joins only the keys it now wins move to it, and when one leaves only its keys move. The
home gets the job unless its load exceeds the least loaded's by more than the slack; then
the least loaded does.
What it records per worker is in `router.workers`. The registry is plain in-process state
driven from one asyncio loop; it is not thread-safe.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from common.address import check_address
from common.kv.layout import KvLayout
from common.roles import KV_ROLES, PROTOCOL_VERSION, Role
from common.wire.kv import layout_from_proto
from common.wire.roles import role_from_proto
from epd.v1 import registry_service_pb2
from router.drains import Holds
from router.refusals import Refusals
from router.workers import (
    CheckpointShape,
    NoWorkerError,
    RegistrationRefused,
    WorkerLoad,
    WorkerRecord,
    check_capabilities,
    check_dtype,
    check_layout,
    rendezvous_weight,
    said_dtype,
)

logger = logging.getLogger(__name__)
_ROLE_ORDER = {role: k for k, role in enumerate(Role)}  # `workers()` lists roles in this order
_address = operator.attrgetter("address")


class Registry:
    """Registered workers by id; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        worker_timeout_s: float,
        heartbeat_interval_s: float,
        expected_model: str | None = None,
        expected_processor: str = "",
        checkpoint_shape: CheckpointShape | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_timeout_s = worker_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.expected_model = expected_model  # None until given or adopted
        self.expected_processor = expected_processor  # encoders' `processor` ("": any)
        self.checkpoint_shape = checkpoint_shape
        self.refusals = Refusals(clock)  # worker address -> why Register refused it
        self.reference_layout: KvLayout | None = None  # first registered KV layout
        self.clock = clock  # the registry's time (time.monotonic; tests pass a fake)
        self._workers: dict[str, WorkerRecord] = {}
        # (role, name) -> address and instance id of the one last dropped for a namesake
        self._replaced: dict[tuple[Role, str], tuple[str, str]] = {}
        self.holds = Holds()  # operators' drains and retirements, by worker name
        self._ticks = itertools.count(1)
        # Called with every newly registered worker (to follow its KV events), and with
        # every one `expire` drops (to stop following them).
        self.on_register: list[Callable[[WorkerRecord], None]] = []
        self.on_expire: list[Callable[[WorkerRecord], None]] = []
        # Called with the old record when another process registers at its address.
        self.on_restart: list[Callable[[WorkerRecord], None]] = []

    # ------------------------------------------------------------------ registration

    def refuse(self, address: str, why: str, role: str = "") -> bool:
        """Note why Register refused the `role` worker at `address` (for `epd status`);
        whether that is news, for the log (`Refusals.note`)."""
        return self.refusals.note(address, why, role)

    def register(self, info: registry_service_pb2.WorkerInfo) -> WorkerRecord:
        """Check and record a worker. Raises ValueError for an incomplete registration and
        `RegistrationRefused` for one that does not fit the deployment; neither changes
        any state."""
        role = role_from_proto(info.role)
        check_address(info.address)
        if info.protocol_version != PROTOCOL_VERSION:
            raise RegistrationRefused(
                f"{role} worker {info.address} speaks protocol "
                f"{info.protocol_version or '(none)'!r}; this router speaks {PROTOCOL_VERSION!r}"
            )
        if self.expected_model is not None and info.model != self.expected_model:
            raise RegistrationRefused(
                f"{role} worker {info.address} serves model {info.model!r}; this deployment "
                f"serves {self.expected_model!r}"
            )
        check_capabilities(role, info)
        theirs, ours = info.processor, self.expected_processor
        if role == Role.ENCODER and theirs and ours and theirs != ours:
            raise RegistrationRefused(
                f"encoder worker {info.address} processes media with other settings "
                f"({theirs}; this router's: {ours}): it would refuse every content hash"
            )
        layout = None
        if role in KV_ROLES:
            if not info.HasField("kv_layout"):
                raise ValueError(f"worker.kv_layout is missing; a {role} worker must send it")
            layout = layout_from_proto(info.kv_layout)
            check_layout(role, info.address, layout, self.checkpoint_shape, self.reference_layout)
        check_dtype(role, info.address, said_dtype(info, layout), self.dtype_now(info.address))
        same_name = [w for w in self._workers.values() if info.name and w.name == info.name]
        namesakes = [w for w in same_name if w.role == role and w.address != info.address]
        dropped = self._replaced.get((role, info.name))
        cutoff = self._cutoff()
        live = [w for w in namesakes if w.last_seen >= cutoff]
        if live and dropped == (info.address, info.instance_id) and info.instance_id:
            # The very process dropped for a namesake is alive, and so is the namesake: two
            # live workers share the name (they would evict each other on every heartbeat,
            # or, refused for a while only, whenever its retries outlast the while). It is
            # refused for as long as the namesake lives.
            raise RegistrationRefused(
                f"{role} worker {info.address} registers as {info.name!r}, the name of "
                f"the live worker at {live[0].address}: worker names must be unique"
            )
        taken = [w for w in self._workers.values() if w.address == info.address]
        if other := [w for w in taken if w.role != role and w.last_seen >= cutoff]:
            raise RegistrationRefused(  # whoever has the token could keep a worker out
                f"{role} worker at {info.address}: the address of the live "
                f"{other[0].role} worker {other[0].name!r}"
            )
        for old in namesakes:
            self._replaced[(role, info.name)] = (old.address, old.info.instance_id)
            # The same named worker restarted at another address (Ray gives a restarted
            # actor a new port): its old address is dead, let go as an expiry would.
            del self._workers[old.worker_id]
            logger.info("worker %s registered again at %s", info.name, info.address)
            for listener in self.on_expire:
                listener(old)
        for old in taken:
            del self._workers[old.worker_id]
            restarted = not info.instance_id or old.info.instance_id != info.instance_id
            again = " after a restart" if restarted else ""
            logger.info("worker %s re-registered%s", old.shown, again)
            if restarted:
                for restart_listener in self.on_restart:
                    restart_listener(old)
        if self.expected_model is None:
            self.expected_model = info.model
            logger.info("adopted model identity %r from %s", info.model, info.address)
        if layout is not None and self.reference_layout is None:
            self.reference_layout = layout
        record = WorkerRecord(
            worker_id=uuid.uuid4().hex,
            role=role,
            address=info.address,
            name=info.name or info.address,
            model=info.model,
            layout=layout,
            info=info,
            last_seen=self.clock(),
        )
        self.holds.apply(record)  # an operator's drain, a retirement: they stand
        self._workers[record.worker_id] = record
        self.refusals.forget(record.address)
        logger.info("registered %s worker %s at %s", role, record.name, record.address)
        for listener in self.on_register:
            listener(record)
        return record

    def dtype_now(self, besides: str = "") -> str | None:
        """The deployment's dtype (`check_dtype`): the registered workers' (but the one at
        `besides`; a silent one until `expire` drops it, as a heartbeat may revive it),
        else the first KV layout's (kept, as that layout), else None."""
        for w in self._workers.values():
            if w.address != besides and said_dtype(w.info, w.layout):
                return said_dtype(w.info, w.layout)
        return self.reference_layout.dtype_name if self.reference_layout else None

    def heartbeat(self, worker_id: str, load: WorkerLoad) -> bool:
        """Refresh a worker's liveness and load; False when the id is unknown."""
        record = self._workers.get(worker_id)
        if record is None:
            return False
        if load.draining and not record.load.draining:
            logger.info("worker %s reports draining", record.shown)
        record.load = load
        record.in_flight_at_heartbeat = record.in_flight
        record.heard(self.clock())
        return True

    def suspect(self, record: WorkerRecord, unreachable: bool = False) -> None:
        """A call on `record` failed UNAVAILABLE: pick others first until it heartbeats
        again, or longer if it was suspected soon before (`WorkerRecord.mark_suspect`). A
        killed or frozen worker stays listed until its heartbeats are missed for
        `worker_timeout_s`, and its calls fail (at once, or after keepalive's pings): every
        request would try it first meanwhile, a frozen one's waiting on a reconnect.
        `unreachable`: its connection was lost (`WorkerRecord.unreachable`)."""
        if not record.suspect:
            logger.info("%s worker %s suspect: a call on it failed", record.role, record.shown)
        record.mark_suspect(self.clock(), self.heartbeat_interval_s)
        record.unreachable = record.unreachable or unreachable

    def drain(self, address: str) -> bool:
        """Give the worker at `address` no new work, it and its name's later registrations
        (`router.drains`) until `undrain`; False when none is registered there."""
        records = [r for r in self._workers.values() if r.address == address]
        self.holds.drain(records)
        for record in records:
            logger.info("draining %s worker %s", record.role, record.shown)
        return bool(records)

    def undrain(self, address: str = "", name: str = "") -> tuple[bool, bool, bool]:
        """Undo `drain` for the worker at `address`, or registered under `name` when no
        address is given: (found, serving, lifted_away). One that reports draining
        (stopping) or that the deployment retires stays draining: serving False.
        lifted_away: a drain held for a worker not registered now (restarting) was lifted."""

        def chosen(r: WorkerRecord) -> bool:
            return r.address == address if address else bool(name) and r.name == name

        records = [r for r in self._workers.values() if chosen(r)]
        lifted_away = self.holds.undrain(records, address=address, name="" if address else name)
        for record in records:
            logger.info("undrained %s worker %s", record.role, record.shown)
        if lifted_away:
            logger.info("lifted the drain held for %s (not registered now)", address or name)
        return bool(records), any(not r.draining for r in records), lifted_away

    def retire(self, name: str, died: bool = False) -> None:
        """The deployment retires the worker `name` (a scale-down, or `died` for good): no
        new work for it, now and whenever it registers again; nothing undoes it (it leaves)."""
        self.holds.retire(name, self._workers.values(), died)
        logger.info("%s worker %s", "holding out the dead" if died else "retiring", name)

    def drained_by_operator(self, name: str) -> bool:
        """Whether an operator drained a worker of this name and has not undrained it."""
        return self.holds.drained(name)

    def excuse(self, stalled_s: float) -> None:
        """The router's own loop stalled for `stalled_s` (GC, CPU starvation, SIGSTOP): the
        heartbeats of that while wait unread, so it counts as no worker's silence: since a
        worker's last heartbeat, at most the longer of this stall and `worker_timeout_s` (a
        dead one is still dropped when every pass runs late)."""
        now, most = self.clock(), max(stalled_s, self.worker_timeout_s)
        for r in self._workers.values():
            shift = min(stalled_s, most - r.excused, now - r.last_seen)
            r.last_seen, r.excused = r.last_seen + max(0.0, shift), r.excused + max(0.0, shift)

    def remove(self, worker_id: str) -> None:
        """Forget a worker (it stopped)."""
        self._workers.pop(worker_id, None)

    def expire(self) -> list[WorkerRecord]:
        """Drop and return the workers silent for longer than the timeout, after calling
        each `on_expire` listener with each of them. The only place a silent record expires
        (`register` drops one a same-named worker replaced)."""
        cutoff = self._cutoff()
        dead = [w for w in self._workers.values() if w.last_seen < cutoff]
        for record in dead:
            del self._workers[record.worker_id]
            if record.died:  # held out since (its death was told: `epd status`, `failed:`)
                logger.info("dropped %s worker %s: it died for good", record.role, record.shown)
            elif record.draining:  # it was leaving: a scale-down, a stop or `epd drain`
                logger.info("retired %s worker %s (drained, stopped)", record.role, record.shown)
            else:
                logger.warning(
                    "dropped %s worker %s: no heartbeat for %.1f s",
                    record.role,
                    record.shown,
                    self.seconds_since(record),
                )
            for listener in self.on_expire:
                listener(record)
        return dead

    def _cutoff(self) -> float:
        """Workers last seen before this clock time count as dead."""
        return self.clock() - self.worker_timeout_s

    # --------------------------------------------------------------------- selection

    def workers(self, role: Role | None = None, timed_out: bool = False) -> list[WorkerRecord]:
        """Live workers (of `role`, or all), ordered by role then address. Changes nothing:
        a silent worker is left out here (kept with `timed_out`) but dropped only by
        `expire`, whose listeners must hear of it."""
        cutoff = -math.inf if timed_out else self._cutoff()
        # A snapshot first: the metrics thread calls this while the loop registers workers
        # (iterating the dict itself failed that scrape: "changed size during iteration").
        every = list(self._workers.values())
        if role is not None:  # on every request's path: one role, ordered by address
            chosen = [w for w in every if w.last_seen >= cutoff and w.role == role]
            return sorted(chosen, key=_address)
        chosen = [w for w in every if w.last_seen >= cutoff]
        return sorted(chosen, key=lambda w: (_ROLE_ORDER[w.role], w.address))

    def unready(self) -> list[Role]:
        """The roles (encoder, prefill, decode) without a registered, serving worker."""
        live = {w.role for w in self.workers() if not w.draining}
        return [role for role in (Role.ENCODER, Role.PREFILL, Role.DECODE) if role not in live]

    def seconds_since(self, record: WorkerRecord) -> float:
        """Seconds since the worker's last register or heartbeat, the router's own stalls
        included (`excuse` moved `last_seen` past them: they count as no silence, but they
        passed)."""
        return max(0.0, self.clock() - record.last_seen + record.excused)

    def pick(
        self,
        role: Role,
        *,
        exclude: frozenset[str] = frozenset(),
        affinity: Callable[[WorkerRecord], int] | None = None,
        key: bytes | None = None,
        slack: int = 2,
    ) -> WorkerRecord:
        """The least loaded live, non-draining worker of `role` whose address is not in
        `exclude`; ties go to the least recently picked. With `affinity` (e.g. cached
        prefix blocks), the worker with the highest affinity among those within `slack`
        requests of the least loaded wins, so a cache hit never piles work on one worker.
        With `key` (instead of `affinity`), the key's rendezvous home among the candidates
        wins when within `slack` of the least loaded, else the least loaded does.
        A suspect worker (`suspect`) is picked only when no other candidate is left. Raises
        `NoWorkerError`. Does not count the request: use `using`."""
        candidates = [w for w in self.workers(role) if not w.draining and w.address not in exclude]
        if not candidates:
            raise NoWorkerError(role, self.refusals.of(str(role)), self.workers(role))
        trusted = [w for w in candidates if not w.suspect]
        candidates = trusted or candidates  # a suspect one only when none other is left
        least = min(w.load_estimate for w in candidates)
        if key is not None:
            home = max(candidates, key=lambda w: (rendezvous_weight(key, w.name), w.address))
            if home.load_estimate <= least + slack:
                best = home
            else:
                best = min(candidates, key=lambda w: (w.load_estimate, w.last_pick))
        elif affinity is not None:
            near = [w for w in candidates if w.load_estimate <= least + slack]
            scores = {w.worker_id: affinity(w) for w in near}
            best = min(near, key=lambda w: (-scores[w.worker_id], w.load_estimate, w.last_pick))
        else:
            best = min(candidates, key=lambda w: (w.load_estimate, w.last_pick))
        best.last_pick = next(self._ticks)
        return best

    @contextmanager
    def using(self, record: WorkerRecord) -> Iterator[WorkerRecord]:
        """Count one in-flight request of this router on `record` while the block runs."""
        record.in_flight += 1
        try:
            yield record
        finally:
            record.in_flight -= 1

    @property
    def active_requests(self) -> int:
        """Requests this router has in flight on any worker, counted per worker."""
        return sum(w.in_flight for w in self._workers.values())
