"""KV event fan-out: a worker's prefix-cache changes, numbered, to every StreamKvEvents.

The allocator calls `KvEventHub.on_event` on the model thread (where every pool change
happens). The hub numbers the event (one monotonic sequence per worker) and hands it to each
subscriber's asyncio queue on the event loop. `subscribe` runs on the model thread too, so
the snapshot it takes (read from the pool) and the live events that follow it never overlap
or leave a gap. Events stay in-process types here; `common.wire.kv` converts them.

`common.server.kv_worker.stream_kv_events` is the one body of every worker's event stream
RPC over a hub (prefill's `StreamKvEvents`, decode's `StreamDecodeKvEvents`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from common.kv.allocator import KvAllocator
from common.kv.block_pool import KvEvent

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NumberedKvEvent:
    """A prefix-cache change with its place in the worker's event sequence."""

    event: KvEvent  # what changed
    sequence: int  # number of the last event included (1, 2, ...; a snapshot repeats it)


# Live events one subscriber may have queued. A subscriber that reads slower than the pool
# changes (a starved or stuck router) would otherwise grow the worker's memory without end;
# past this its stream ends and it subscribes again, from a fresh snapshot.
MAX_QUEUED_EVENTS = 65536


@dataclass(eq=False, slots=True)
class Subscription:
    """One StreamKvEvents stream's queue of live events."""

    loop: asyncio.AbstractEventLoop  # the loop that owns `queue`
    queue: asyncio.Queue[NumberedKvEvent] = field(default_factory=asyncio.Queue)
    overflowed: bool = False  # `MAX_QUEUED_EVENTS` were waiting: later events were dropped

    def offer(self, event: NumberedKvEvent) -> None:
        """Queue `event` (on `loop`) unless the subscriber fell too far behind."""
        if self.overflowed or self.queue.qsize() >= MAX_QUEUED_EVENTS:
            self.overflowed = True
            return
        self.queue.put_nowait(event)


class KvEventHub:
    """Numbers the allocator's KV events and fans them out; see the module docstring."""

    def __init__(self, allocator: KvAllocator) -> None:
        self._allocator = allocator
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self.sequence = 0  # sequence number of the last event made
        allocator.listeners.append(self.on_event)

    def on_event(self, event: KvEvent) -> None:
        """Allocator listener (model thread): number the event and queue it for everyone."""
        with self._lock:
            self.sequence += 1
            numbered = NumberedKvEvent(event, self.sequence)
            subs = list(self._subs)
        for sub in subs:
            sub.loop.call_soon_threadsafe(sub.offer, numbered)

    def subscribe(self, sub: Subscription) -> NumberedKvEvent:
        """Add a subscriber and return the snapshot event: "stored" with every cached hash
        (oldest first), numbered with the current sequence. Call on the model thread."""
        with self._lock:
            self._subs.append(sub)
            snapshot = KvEvent("stored", tuple(self._allocator.cached_hashes()))
            return NumberedKvEvent(snapshot, self.sequence)

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop feeding a subscriber (any thread)."""
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    @property
    def subscribers(self) -> int:
        """Streams currently subscribed."""
        with self._lock:
            return len(self._subs)
