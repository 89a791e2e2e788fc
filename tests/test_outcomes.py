"""How a request ended (`router.outcomes`), for the cases its metric and log line tell
apart by more than the status code."""

from __future__ import annotations

import time

import grpc

from router.calls import Refused, TooLarge
from router.outcomes import Outcome


def test_a_request_that_can_never_fit_is_invalid_not_refused_for_load() -> None:
    # Counted `refused` (for load: what operators alert on for capacity), while the HTTP
    # client got a 400 for it (operator2 review L4, s44); a full queue is still `refused`.
    never = Outcome("r1", None, time.monotonic())
    never.failed(TooLarge("needs 7 KV blocks; the largest decode worker has 6 in all"))
    assert never.failure == "invalid"
    assert never.detail.startswith("RESOURCE_EXHAUSTED needs 7 KV blocks")
    full = Outcome("r2", None, time.monotonic())
    full.failed(Refused("the queue is full", 1.0))
    assert (full.failure, TooLarge("x").code) == ("refused", grpc.StatusCode.RESOURCE_EXHAUSTED)
