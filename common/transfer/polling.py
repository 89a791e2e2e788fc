"""One NIXL READ posted and waited for (`post_and_wait`: spin briefly, then poll with back-off
until the transfer is done, fails, or its deadline passes), then its handle released once
it may be (`run_read`): at once when it ended, else parked (`common.transfer.parked`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final

from common.transfer.parked import ParkedHandles
from common.transfer.types import TransferError, TransferTimeoutError

logger = logging.getLogger(__name__)

# Waiting for a transfer: spin on the status this long first (small transfers finish within
# microseconds, and a sleep on a busy machine can cost a whole scheduler slice), then sleep
# with back-off: first sleep, growth factor, ceiling (seconds). The ceiling stays well under
# one large transfer's time so polling adds little latency.
_SPIN_S: Final = 100e-6
_POLL_FIRST_S: Final = 20e-6
_POLL_GROWTH: Final = 2.0
_POLL_MAX_S: Final = 200e-6


def post_and_wait(
    agent: Any, handle: Any, peer: str, nbytes: int, timeout_s: float, started: float
) -> None:
    """Post a prepared transfer on the nixl `agent` and poll it until DONE.

    Raises TransferTimeoutError once `timeout_s` has passed since `started` and
    TransferError if NIXL reports a failure. The caller releases the handle either way.
    """
    state = agent.transfer(handle)
    sleep_s = _POLL_FIRST_S
    deadline = started + timeout_s
    spin_until = time.perf_counter() + _SPIN_S
    while state == "PROC" and time.perf_counter() < spin_until:
        state = agent.check_xfer_state(handle)
    while state == "PROC":
        if time.perf_counter() >= deadline:
            raise TransferTimeoutError(
                f"READ of {nbytes} bytes from {peer!r} timed out after {timeout_s} s"
            )
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * _POLL_GROWTH, _POLL_MAX_S)
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise TransferError(f"READ of {nbytes} bytes from {peer!r} failed (state {state})")


def run_read(
    nixl: Any,
    parked: ParkedHandles,
    handle: Any,
    peer: str,
    nbytes: int,
    timeout_s: float,
    started: float,
    on_park: Callable[[Future[None]], object],
) -> None:
    """Post a prepared READ on the nixl agent `nixl` and wait for it (`post_and_wait`); its
    handle is released, or parked in `parked` where it may not be yet: it may still write,
    and `on_park` is given the future set once it is let go (the error raised then, but
    for an interruption, is a `TransferTimeoutError` whose `released` is that future)."""

    def park(ended: Callable[[], bool] | None) -> Future[None]:
        released = parked.park(handle, ended)
        on_park(released)
        return released

    def ended() -> bool:  # the transfer writes no more: it is over, failed, or its peer gone
        try:
            return bool(nixl.check_xfer_state(handle) != "PROC")
        except Exception as exc:  # but its peer unloaded here (the agent closing): unknown
            return not _unknown(exc)

    try:
        post_and_wait(nixl, handle, peer, nbytes, timeout_s, started)
    except TransferTimeoutError as exc:
        # Not released now: NIXL would say it cancelled the READ, but over TCP the holder's
        # bytes still land once it gets going again, into memory the caller would have
        # given another request (races review). Kept until it ends.
        exc.released = park(ended)
        exc.cancelled = False
        raise
    except Exception as exc:
        if (not isinstance(exc, TransferError) and _unknown(exc)) or not ended():
            # Its peer was unloaded here (the agent closes), or it is still under way
            # however it failed: it may still be writing, as after a timeout (ownfix and
            # kvimport reviews).
            error = TransferTimeoutError(
                f"READ of {nbytes} bytes from {peer!r} broke off ({exc}); kept until it ends",
                cancelled=False,
            )
            error.released = park(ended)
            raise error from exc
        kept = _release(parked, handle, False)
        if kept is not None:
            on_park(kept)
            # NIXL kept a transfer it would not release: it may still write the local
            # ranges, so the caller must keep them, as after a timeout.
            error = TransferTimeoutError(
                f"READ of {nbytes} bytes from {peer!r} failed ({exc}) and could not be released",
                cancelled=False,
            )
            error.released = kept
            raise error from exc
        if not isinstance(exc, TransferError):
            # The binding's own errors, e.g. NIXL_ERR_REMOTE_DISCONNECT from a dead peer.
            raise TransferError(f"READ of {nbytes} bytes from {peer!r} failed: {exc}") from exc
        raise
    except BaseException:  # interrupted while it may be writing: kept until it ends
        park(ended)
        raise
    _release(parked, handle, True)


def _unknown(exc: Exception) -> bool:
    """Whether NIXL's error says it no longer knows the transfer's peer (NIXL_ERR_NOT_FOUND:
    unloaded here, "invalidated ... during transfer"): the transfer may still be writing.
    Its other errors (a disconnect, a backend failure, a cancel) end it."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "not_found" in text or "notfound" in text or "invalidated" in text


def _release(parked: ParkedHandles, handle: Any, done: bool) -> Future[None] | None:
    """Release a transfer handle: None, or, if NIXL refuses, the future `parked` sets once
    it lets the handle go."""
    try:
        handle.release()
        return None
    except Exception:  # NIXL refuses to release a transfer it cannot cancel: retried later
        which = "a finished" if done else "an unfinished"
        logger.warning("%s could not release %s transfer handle; will retry", parked.name, which)
        return parked.park(handle)
