"""KV event fan-out: the runner's prefix-cache changes, numbered, to every StreamKvEvents.

The runner calls `KvEventHub.on_event` on the model thread (where every pool change
happens). The hub numbers the event (one monotonic sequence per worker) and hands it to each
subscriber's asyncio queue on the event loop. `subscribe` runs on the model thread too, so
the snapshot it takes and the live events that follow it never overlap or leave a gap.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from common.kv.block_pool import KvEvent
from common.models.runner import LmRunner
from epd.v1 import kv_pb2

_KINDS = {
    "stored": kv_pb2.KV_EVENT_KIND_STORED,
    "removed": kv_pb2.KV_EVENT_KIND_REMOVED,
    "cleared": kv_pb2.KV_EVENT_KIND_CLEARED,
}


@dataclass(eq=False, slots=True)
class Subscription:
    """One StreamKvEvents stream's queue of live events."""

    loop: asyncio.AbstractEventLoop  # the loop that owns `queue`
    queue: asyncio.Queue[kv_pb2.KvEvent] = field(default_factory=asyncio.Queue)


class KvEventHub:
    """Numbers the runner's KV events and fans them out; see the module docstring."""

    def __init__(self, runner: LmRunner) -> None:
        self._runner = runner
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self.sequence = 0  # sequence number of the last event made
        runner.event_listeners.append(self.on_event)

    def on_event(self, event: KvEvent) -> None:
        """Runner listener (model thread): number the event and queue it for everyone."""
        with self._lock:
            self.sequence += 1
            msg = kv_pb2.KvEvent(
                kind=_KINDS[event.kind],
                block_hashes=list(event.block_hashes),
                sequence=self.sequence,
            )
            subs = list(self._subs)
        for sub in subs:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, msg)

    def subscribe(self, sub: Subscription) -> kv_pb2.KvEvent:
        """Add a subscriber and return the snapshot event: STORED with every cached hash,
        numbered with the current sequence. Call on the model thread."""
        with self._lock:
            self._subs.append(sub)
            return kv_pb2.KvEvent(
                kind=kv_pb2.KV_EVENT_KIND_STORED,
                block_hashes=self._runner.cached_hashes(),
                sequence=self.sequence,
            )

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
