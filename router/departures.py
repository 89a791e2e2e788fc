"""What the router lets go of when workers leave: a silent worker's record (dropped by the
registry's expiry, every `period_s`), and then its gRPC channel (with any other channel to an
address no worker is registered at: a release sent after a worker left opens one) and
KV-event subscription; a restarted worker's old channel and prefix entries (none of its
blocks survived). Calls in flight on a dropped worker's channel end with UNAVAILABLE and are
tried on another worker (`common.server.peers`)."""

from __future__ import annotations

import asyncio
import logging

from router.orchestrator import Orchestrator
from router.registry import Registry
from router.workers import WorkerRecord

logger = logging.getLogger(__name__)
# A wake-up of the expiry loop this much late counts as the router's stall, up to
# `worker_timeout_s` since each worker's last heartbeat (`Registry.excuse`).
LATE_S = 0.05


async def expire_loop(registry: Registry, orchestrator: Orchestrator, period_s: float) -> None:
    """Drop silent workers every `period_s`, and forget the channel and KV-event subscription
    of every worker that expired (whoever called `expire`) unless one registered again at its
    address since. A late wake-up is a stall of this loop, whose time the registry does not
    count as silence (`Registry.excuse`): the heartbeats of that while wait unread, and a
    pass would drop every worker at once, breaking every call (with a heartbeat of 3 s and a
    timeout of 5 s, a stall under a heartbeat interval dropped some)."""
    gone: list[str] = []
    # A listener, not expire's return value: an expiry run elsewhere must not be missed, or
    # the router would resubscribe to a dead address forever.
    registry.on_expire.append(lambda record: gone.append(record.address))
    while True:
        asleep = registry.clock()
        await asyncio.sleep(period_s)
        late = registry.clock() - asleep - period_s
        if late > LATE_S:  # any lateness: a worker may be one interval from its timeout
            if late > registry.heartbeat_interval_s:
                logger.warning("router loop stalled %.1f s: not counted as workers' silence", late)
            registry.excuse(late)
        registry.expire()
        addresses, gone[:] = dict.fromkeys(gone), []
        live = {w.address for w in registry.workers()}
        for address in addresses:
            if address not in live:
                orchestrator.prefix.forget(address)
        orchestrator.channels.keep_only(live)


def forget_restarted(orchestrator: Orchestrator, old: WorkerRecord) -> None:
    """A new process registered at `old`'s address: drop what followed the old one (its
    KV-event subscription and prefix entries: none of its blocks survived; its channel,
    which may sit in reconnect back-off). The new record's `on_register` follows it anew."""
    orchestrator.prefix.forget(old.address)
    orchestrator.channels.forget(old.address)
