"""`Controller.wait_ready` over fake pools (no Ray): a worker that failed to start is
reported, and the other workers' failures that come after are retrieved, not left to
asyncio's "Task exception was never retrieved" (two full Ray tracebacks after `epd serve`'s
one clear line)."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.deployment import Controller
from cluster.pools import WorkerStartError
from common.server.credentials import NO_CREDENTIALS


class Failing:
    """A worker actor whose creation failed after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.describe = SimpleNamespace(remote=lambda: self._fail(delay_s))

    async def _fail(self, delay_s: float) -> Any:
        await asyncio.sleep(delay_s)
        raise RuntimeError(f"no checkpoint ({delay_s} s)")


class Pools:
    def replicas(self) -> dict[str, int]:
        return {"prefill": 2}

    def members(self, role: str) -> list[tuple[str, Any]]:
        return [("p0", Failing(0.01)), ("p1", Failing(0.2))] if role == "prefill" else []


async def test_the_failures_after_the_first_are_retrieved() -> None:
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    controller = Controller.__new__(Controller)  # its fields, not its actor's start
    controller.pools = Pools()  # type: ignore[assignment]
    controller.router = SimpleNamespace(registry=SimpleNamespace(refusals={}))
    controller.router_address = "127.0.0.1:1"
    controller.credentials = NO_CREDENTIALS
    with pytest.raises(WorkerStartError, match="p0 failed to start"):
        await controller.wait_ready(10)
    await asyncio.sleep(0.4)  # p1 fails meanwhile
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []
