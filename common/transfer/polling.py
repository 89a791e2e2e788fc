"""Waiting for one posted NIXL transfer: spin briefly, then poll with back-off until the
transfer is done, fails, or its deadline passes. Releasing the handle is the caller's job."""

from __future__ import annotations

import time
from typing import Any, Final

from common.transfer.types import TransferError, TransferTimeoutError

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
