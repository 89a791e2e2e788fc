"""Transfer handles not released yet: a READ that timed out, parked until it ends (NIXL's
release of one in flight says it cancelled it, but over TCP the holder's bytes still land
once it gets going again, into memory by then another request's: a second request's
verified, cached KV blocks were overwritten so; races review), and one NIXL would not
release. Each is released once it may be, and its future set then, so that whoever kept
the local memory for it (quarantined KV blocks, a registered tensor) frees it then rather
than never, or too early. A READ whose holder stays frozen stays parked, its memory kept.

Retried on every `retry()` (the agent calls it before each READ) and every `retry_s` on a
timer thread of its own while any handle is parked: memory kept for one comes back even
when no READ follows (an idle worker, or one whose pool the kept blocks filled). Futures
are set, and their callbacks run, on the retrying thread with no lock held.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final

logger = logging.getLogger(__name__)

RETRY_S: Final = 1.0  # how often parked handles are released again while any is parked
# A handle, its future, and whether its transfer has ended (None: no need to ask).
_Parked = tuple[Any, Future[None], Callable[[], bool] | None]


class ParkedHandles:
    """The handles one agent could not release (thread-safe)."""

    def __init__(self, name: str, retry_s: float = RETRY_S) -> None:
        self.name = name  # the agent's, for logs
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._retrying = threading.Lock()  # one `retry` at a time (`close` waits for it)
        self._parked: list[_Parked] = []
        self._timer: threading.Timer | None = None
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)

    def park(self, handle: Any, ended: Callable[[], bool] | None = None) -> Future[None]:
        """Keep `handle` until `ended()` (its transfer will write no more; not asked if
        None), then release it; the future is set once it is released."""
        released: Future[None] = Future()
        with self._lock:
            self._parked.append((handle, released, ended))
            self._schedule()
        return released

    def retry(self) -> None:
        """Release what NIXL now lets go, and set those handles' futures (at once if
        another thread is doing so; none once closed: the agent's NIXL is gone)."""
        if self._retrying.acquire(blocking=False):
            try:
                if not self._closed:  # a tick that fired as `close` ran (s35 review)
                    self._retry()
            finally:
                self._retrying.release()

    def _retry(self) -> None:
        with self._lock:
            parked, self._parked = self._parked, []
        freed: list[Future[None]] = []
        still: list[_Parked] = []
        for handle, released, ended in parked:
            if ended is not None and not _has_ended(ended):
                still.append((handle, released, ended))
                continue
            try:
                handle.release()
            except Exception:
                still.append((handle, released, None))  # ended: only its release is left
            else:
                freed.append(released)
        with self._lock:
            self._parked.extend(still)
            self._schedule()
        if freed:
            logger.info("%s released %d parked transfer handles", self.name, len(freed))
        for released in freed:
            released.set_result(None)

    def close(self) -> int:
        """Release what can be, then stop retrying (what is left stays parked for good);
        how many are left (counted once no other thread holds some while it retries: a
        close that saw none freed memory they then wrote; ownfix review)."""
        with self._retrying:
            self._retry()
            with self._lock:
                self._closed = True
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                return len(self._parked)

    def _schedule(self) -> None:
        """Start the timer if handles wait and none runs (lock held)."""
        if self._parked and self._timer is None and not self._closed:
            self._timer = threading.Timer(self.retry_s, self._tick)
            self._timer.daemon = True
            self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
        self.retry()


def _has_ended(ended: Callable[[], bool]) -> bool:
    """`ended()`, where an error asking says nothing (not ended: kept)."""
    try:
        return ended()
    except Exception:
        return False
