"""Leases: the prefill worker's record of which prompt blocks it keeps pinned for a decode
worker, and until when.

Lifecycle of a lease: `add` (Prefill hands its sequence's block references to the lease)
-> `pop` (ReleaseKv from the decode worker, or the router) or `pop_expired` (the reaper,
once `ttl_s` passed: a decode worker that died never releases). Whoever pops a lease owns
its block references and must release them to the pool exactly once; a lease is popped at
most once, so no block is released twice and none leaks.

Touched only from the server's event loop (not thread-safe).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    """Blocks pinned for one handed-off prompt."""

    lease_id: str  # opaque id sent in the KvHandle
    blocks: list[int]  # block ids, one pool reference each, owned by the lease
    expires_at: float  # clock() time after which the reaper frees the blocks
    request_id: str  # the prefill request's id, for logs


class LeaseTable:
    """Live leases by id; see the module docstring for ownership."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.ttl_s = ttl_s  # lifetime of a new lease
        self.clock = clock  # monotonic time source
        self._leases: dict[str, Lease] = {}
        self.expired = 0  # leases reaped since start
        self.released = 0  # leases released by ReleaseKv since start

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def pinned_blocks(self) -> int:
        """Block references held by live leases."""
        return sum(len(lease.blocks) for lease in self._leases.values())

    def add(self, blocks: list[int], request_id: str = "") -> Lease:
        """A new lease owning one reference on each of `blocks`."""
        lease = Lease(uuid.uuid4().hex, list(blocks), self.clock() + self.ttl_s, request_id)
        self._leases[lease.lease_id] = lease
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        """Remove and return a live lease (None when unknown or already gone)."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.released += 1
        return lease

    def pop_expired(self) -> list[Lease]:
        """Remove and return every lease past its expiry."""
        now = self.clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.lease_id]
        self.expired += len(gone)
        return gone

    def pop_all(self) -> list[Lease]:
        """Remove and return every lease (shutdown)."""
        gone = list(self._leases.values())
        self._leases.clear()
        return gone

    def next_expiry(self) -> float | None:
        """The earliest expiry among live leases, or None."""
        return min((lease.expires_at for lease in self._leases.values()), default=None)
