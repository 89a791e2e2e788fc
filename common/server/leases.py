"""Leases: what a worker keeps alive for a peer that will read it, and until when.

One table serves both kinds of lease epd has: the prefill worker's pinned prompt blocks
(held = block ids, released by `ReleaseKv`) and the encoder's registered output buffers
(held = the buffer and its NIXL registration, released by `ReleaseEmbeddings`).

Lifecycle of a lease: `add` (the table now holds `held`) -> `renew` (a reader still waiting
to read keeps it alive; optional, repeatable) -> `pop` (the reader released it)
or `pop_expired` (the reaper, once `ttl_s` passed: a reader that died never releases) or
`pop_all` (shutdown). Whoever pops a lease owns what it holds and must free it exactly once;
a lease is popped at most once, so nothing is freed twice and nothing leaks.

Ids chosen by the caller: a caller that asks for a lease may name its id (`add(lease_id=)`),
so that it can release the lease even when the answer carrying it never reaches it (its call
cancelled or timed out after the lease was made). Such a release may come first:
`pop_or_bar` of an id no live lease has bars it, and `add` refuses a barred id (`LeaseIdError`)
for `ttl_s` after, so a lease released before it was made is never made. A chosen id is
barred as well once its lease is released or expires: a reader still holding a handle of
the old lease would otherwise be told by the new one's id that its lease was live (s42
kvtrust review: an expired lease's reader confirmed against a new lease under its id).
Barred ids are kept in arrival order and forgotten once `ttl_s` old, at most `MAX_BARRED`
of them (beyond that the oldest go first, as without the bar).

The reaper (`start_reaper`) is a task of the table's own: every `interval_s` it pops the
expired leases and awaits `on_expire(lease)` for each, which frees what the lease held.
`stop_reaper` cancels it. Touched only from the server's event loop (not thread-safe).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

import grpc

from common.server.rpc import RpcStatusError, logged
from common.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BARRED: Final = 1 << 16  # ids released before their lease was made, remembered at most
_LEASE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


class LeaseIdError(ValueError):
    """A caller's lease id cannot be used: malformed, live already, or released before its
    lease was made (`reason`: "malformed", "live", "released")."""

    def __init__(self, lease_id: str, reason: str) -> None:
        super().__init__(f"lease id {lease_id[:80]!r} is {reason}")
        self.reason = reason


def refusal(exc: LeaseIdError, field: str) -> RpcStatusError:
    """The answer to a call whose caller-chosen lease id (in `field`) cannot be used:
    released by the caller already (CANCELLED: it gave the call up), live already
    (ALREADY_EXISTS) or malformed (INVALID_ARGUMENT)."""
    code = {
        "live": grpc.StatusCode.ALREADY_EXISTS,
        "released": grpc.StatusCode.CANCELLED,
    }.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT)
    return RpcStatusError(code, f"{field}: {exc}")


def check_lease_id(lease_id: str) -> None:
    """Raise LeaseIdError unless `lease_id` is 1 to 64 characters of [A-Za-z0-9_-]."""
    if not _LEASE_ID.fullmatch(lease_id):
        raise LeaseIdError(lease_id, "malformed")


@dataclass(frozen=True, slots=True)
class Lease(Generic[T]):
    """One thing held for a reader."""

    lease_id: str  # opaque id the reader releases by
    held: T  # what the lease keeps alive (block ids, a registered buffer); owned by it
    expires_at: float  # clock() time after which the reaper frees it
    request_id: str  # the request it was made for, for logs
    ttl_s: float  # the lifetime it was given, which a renewal gives it again from then
    chosen: bool = False  # its id was the caller's (barred once the lease is gone)


class LeaseTable(Generic[T]):
    """Live leases by id, with their reaper; see the module docstring for ownership.

    Counters (since start): `released` (popped by a reader), `expired` (reaped).
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.ttl_s = ttl_s  # lifetime of a new lease
        self.clock = clock  # monotonic time source
        self._leases: dict[str, Lease[T]] = {}
        self._barred: OrderedDict[str, float] = OrderedDict()  # id -> when it is forgotten
        self._reaper: asyncio.Task[None] | None = None
        self.expired = 0  # leases reaped since start
        self.released = 0  # leases popped by their reader since start

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def add(
        self,
        held: T,
        request_id: str = "",
        ttl_s: float | None = None,
        lease_id: str | None = None,
    ) -> Lease[T]:
        """A new lease, owning `held` until it is popped; it lives `ttl_s` (default: the
        table's `ttl_s`). `lease_id`: the caller's choice (None: a random one); LeaseIdError
        when it is malformed, live or barred (`check`), and then nothing is added."""
        chosen = lease_id is not None
        if lease_id is None:
            lease_id = uuid.uuid4().hex
        else:
            self.check(lease_id)
        lifetime = self.ttl_s if ttl_s is None else ttl_s
        expires_at = self.clock() + lifetime
        lease = Lease(lease_id, held, expires_at, logged(request_id), lifetime, chosen)
        self._leases[lease_id] = lease
        return lease

    def check(self, lease_id: str) -> None:
        """Raise LeaseIdError unless `add` would take `lease_id` now."""
        check_lease_id(lease_id)
        if lease_id in self._leases:
            raise LeaseIdError(lease_id, "live")
        self._forget_barred()
        if lease_id in self._barred:
            raise LeaseIdError(lease_id, "released")

    def pop_or_bar(self, lease_id: str) -> Lease[T] | None:
        """`pop`; when no lease is live under `lease_id`, bar the id instead: `add` refuses
        it for `ttl_s` (the release of a lease not made yet, see the module docstring)."""
        lease = self.pop(lease_id)
        if lease is None and _LEASE_ID.fullmatch(lease_id):  # no other id is ever leased
            self._bar(lease_id)
        return lease

    def _bar(self, lease_id: str) -> None:
        self._forget_barred()
        self._barred[lease_id] = self.clock() + self.ttl_s
        self._barred.move_to_end(lease_id)
        while len(self._barred) > MAX_BARRED:
            self._barred.popitem(last=False)

    def _gone(self, lease: Lease[T]) -> None:
        """A lease left the table (released or expired): its id, if the caller's, is never
        that of a new lease for `ttl_s`."""
        if lease.chosen:
            self._bar(lease.lease_id)

    def _forget_barred(self) -> None:
        now = self.clock()
        barred = self._barred
        while barred and next(iter(barred.values())) <= now:
            barred.popitem(last=False)

    def pop(self, lease_id: str) -> Lease[T] | None:
        """Remove and return a lease not yet popped (None when unknown or already gone). A
        lease past its expiry that the reaper has not popped yet is returned: what it holds
        was never freed."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.released += 1
            self._gone(lease)
        return lease

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease[T] | None:
        """Push a live lease's expiry to `ttl_s` (default: the lifetime it was given, which
        may exceed the table's) from now, never earlier than it was; None (nothing changed)
        when it is unknown or already expired."""
        lease = self._leases.get(lease_id)
        now = self.clock()
        if lease is None or lease.expires_at <= now:
            return None
        expires_at = max(lease.expires_at, now + (lease.ttl_s if ttl_s is None else ttl_s))
        lease = dataclasses.replace(lease, expires_at=expires_at)
        self._leases[lease_id] = lease
        return lease

    def pop_expired(self) -> list[Lease[T]]:
        """Remove and return every lease past its expiry."""
        now = self.clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.lease_id]
            self._gone(lease)
        self.expired += len(gone)
        return gone

    def pop_all(self) -> list[Lease[T]]:
        """Remove and return every lease (shutdown)."""
        gone = list(self._leases.values())
        self._leases.clear()
        return gone

    def start_reaper(
        self,
        on_expire: Callable[[Lease[T]], Awaitable[None]],
        interval_s: float | None = None,
    ) -> None:
        """Start the reaper task (idempotent; needs a running loop). Every `interval_s`
        (default: a quarter of the TTL, within [10 ms, 1 s]) each expired lease is popped
        and `await on_expire(lease)` frees it; a failing `on_expire` is logged."""
        if self._reaper is None:
            period = interval_s or min(max(self.ttl_s / 4, 0.01), 1.0)
            self._reaper = asyncio.create_task(self._reap(on_expire, period), name="epd-reaper")

    async def stop_reaper(self) -> None:
        """Cancel the reaper and wait for it (idempotent)."""
        task, self._reaper = self._reaper, None
        await cancel_and_wait(task)

    async def _reap(self, on_expire: Callable[[Lease[T]], Awaitable[None]], period: float) -> None:
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            due = [lease.lease_id for lease in self._leases.values() if lease.expires_at <= now]
            # One at a time: a lease stays in the table until its turn, so one released
            # meanwhile, or made anew under a released one's id (a caller-chosen id), is not
            # freed, and stopping the reaper mid-way leaves the rest
            # to `pop_all` (a worker's shutdown frees them) instead of losing them.
            for lease_id in due:
                lease = self._leases.get(lease_id)
                if lease is None or lease.expires_at > now:
                    continue
                del self._leases[lease_id]
                self._gone(lease)
                self.expired += 1
                logger.warning(
                    "lease %s (request %s) expired unreleased", lease.lease_id, lease.request_id
                )
                try:
                    await on_expire(lease)
                except Exception:
                    logger.exception("freeing expired lease %s failed", lease.lease_id)
