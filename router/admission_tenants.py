"""What each tenant holds in admission (`router.admission`), where `[router] tenant_share`
applies (the API keys name several client tenants; `RouterSettings.tenant_share_for`).

Two rules per tenant, both by `share` of the router's bounds:
- places in the admission queue: at most `max(1, int(max_queued * share))` of its requests
  wait at once; one more is refused;
- KV blocks reserved on each KV role's workers, where tenants compete for them: while
  another tenant has a request waiting, a request is *over* its tenant's share when its
  blocks on a role, with the tenant's already reserved there, would pass `share` of the
  role's capacity (the sum over its live workers' heartbeated pools), unless the tenant
  holds none there (so a request larger than a share still runs, alone). The queue places
  the first waiter that is not over its share (the first, when all are), so one tenant's
  backlog does not hold up the others' requests queued behind it. A tenant alone (no other
  waiting) may take all of the KV (a share is an order among waiters, not a reservation),
  and nothing placed is taken back.

Capacity unknown (a worker without a heartbeat yet, or no live worker of the role): no KV
share is applied for that role, as the ledger does not account such a worker either. Plain
state of the admission's loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from common.roles import KV_ROLES, Role


class TenantShares:
    """Per-tenant queue places and KV blocks; inert (never full) when `share` is 1."""

    def __init__(self, share: float, max_queued: int) -> None:
        self.share = share if share < 1 else None  # None: no per-tenant share
        # Most requests of one tenant waiting at once (0: no bound of its own).
        self.queue_places = max(1, int(max_queued * share)) if self.share else 0
        self._queued: Counter[str] = Counter()  # requests waiting now, per tenant
        self._blocks: dict[Role, Counter[str]] = {r: Counter() for r in KV_ROLES}  # reserved now

    def _of(self, tenant: str | None) -> str | None:
        """`tenant` where a share applies to it, else None."""
        return tenant if self.share is not None else None

    # ------------------------------------------------------------------------ queue

    def queued(self, tenant: str | None) -> int:
        """Requests of `tenant` waiting now (counted where a share applies)."""
        t = self._of(tenant)
        return 0 if t is None else self._queued[t]

    def queue_full(self, tenant: str | None) -> bool:
        """Whether `tenant` already waits in all its places."""
        t = self._of(tenant)
        return t is not None and self._queued[t] >= self.queue_places

    def enter(self, tenant: str | None) -> None:
        """A request of `tenant` starts waiting."""
        if (t := self._of(tenant)) is not None:
            self._queued[t] += 1

    def leave(self, tenant: str | None) -> None:
        """It stops waiting (placed, refused or gone)."""
        if (t := self._of(tenant)) is not None:
            self._queued[t] -= 1
            if not self._queued[t]:
                del self._queued[t]

    def _others_wait(self, tenant: str) -> bool:
        return len(self._queued) > (tenant in self._queued)

    @property
    def waiting(self) -> int:
        """Tenants with requests waiting now."""
        return len(self._queued)

    # ---------------------------------------------------------------------- KV blocks

    def blocks(self, tenant: str, role: Role) -> int:
        """KV blocks `tenant` has reserved on `role`'s workers now."""
        return self._blocks[role][tenant]

    def over(
        self,
        tenant: str | None,
        blocks: Callable[[Role], int],
        capacity: Callable[[Role], int | None],
    ) -> Role | None:
        """The first KV role on which `blocks(role)` more (some) would pass `tenant`'s share of
        `capacity(role)` (its workers' blocks in all; None: unknown, no share applied),
        while it holds some there already and another tenant waits; None if none."""
        t = self._of(tenant)
        if t is None or self.share is None or not self._others_wait(t):
            return None
        for role in KV_ROLES:  # one needing none of a role's (a one-token answer) passes none
            held, total, more = self._blocks[role][t], capacity(role), blocks(role)
            if more and held and total is not None and held + more > self.share * total:
                return role
        return None

    def take(self, tenant: str | None, role: Role, blocks: int) -> None:
        if (t := self._of(tenant)) is not None:
            self._blocks[role][t] += blocks

    def give(self, tenant: str | None, role: Role, blocks: int) -> None:
        if (t := self._of(tenant)) is not None:
            held = self._blocks[role]
            held[t] -= blocks
            if held[t] <= 0:
                del held[t]
