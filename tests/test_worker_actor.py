"""The worker actor without a Ray cluster: it serves its role (a stand-in `serve` found
through `SERVER_MODULES`) on its node's IP and describes itself, a drain waits for the leases
held for peers before draining and stopping the server (and reports leases that outlive the
timeout), and `reachable_address` replaces wildcard hosts with the node's IP."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

import cluster.worker as worker
from cluster.settings import EpdSettings
from cluster.worker import SERVER_MODULES, WorkerActor, reachable_address


def test_reachable_address_replaces_wildcards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker, "_node_ip", lambda: "10.1.2.3")
    assert reachable_address("0.0.0.0:50051") == "10.1.2.3:50051"
    assert reachable_address("[::]:7000") == "10.1.2.3:7000"
    assert reachable_address("127.0.0.1:50051") == "127.0.0.1:50051"


# ------------------------------------------------------------------------ worker actor


@dataclass
class FakeServer:
    """What a role's `serve` returns (a `RoleServer`), reduced to what WorkerActor uses."""

    settings: Any
    log: list[str]
    address: str = "127.0.0.1:4242"
    leases: int = 2  # leases held for peers
    registrar: Any = None  # registrations (none: it registers with no router)

    def outstanding_leases(self) -> int:
        return self.leases

    async def drain(self, timeout_s: float) -> bool:
        self.log.append("lifecycle-drain")
        await self.stop(0)
        return True

    async def stop(self, grace_s: float | None = 5.0) -> None:
        self.log.append("stop")


SERVED: list[FakeServer] = []


async def serve(settings: Any) -> FakeServer:
    """Stand-in for a role's `serve`, found through `SERVER_MODULES`."""
    server = FakeServer(settings, [])
    SERVED.append(server)
    return server


async def _worker(monkeypatch: pytest.MonkeyPatch) -> WorkerActor:
    monkeypatch.setitem(SERVER_MODULES, "prefill", __name__)
    monkeypatch.setattr(worker, "_node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(worker, "setup_logging", lambda level: None)  # keep pytest's logging
    actor = WorkerActor.__new__(WorkerActor)
    settings = EpdSettings().prefill
    await actor.__init__("prefill", "epd-prefill-0", settings, "warning")  # type: ignore[misc]
    return actor


async def test_worker_actor_serves_and_describes_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    actor = await _worker(monkeypatch)
    assert repr(actor) == "epd-prefill-0"
    assert SERVED[-1].settings.host == "127.0.0.1"  # its node's IP: no host was given
    description = await actor.describe()
    assert dataclasses.astuple(description)[:3] == ("prefill", "epd-prefill-0", "127.0.0.1:4242")
    assert description.failing == ()  # no router to fail on
    refused = "127.0.0.1:1: UNAUTHENTICATED: bad cluster token"
    SERVED[-1].registrar = SimpleNamespace(failing=lambda: [refused])
    assert (await actor.describe()).failing == (refused,)  # what `epd serve` says of it


async def test_worker_drain_waits_for_leases_then_drains_then_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    actor = await _worker(monkeypatch)
    server = SERVED[-1]

    async def release_later() -> None:
        await asyncio.sleep(0.2)
        server.log.append("leases released")
        server.leases = 0

    releaser = asyncio.create_task(release_later())
    assert await actor.drain(timeout_s=5) is True
    await releaser
    assert server.log == ["leases released", "lifecycle-drain", "stop"]


async def test_worker_drain_reports_leases_that_outlive_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    actor = await _worker(monkeypatch)
    assert await actor.drain(timeout_s=0.2) is False
    assert SERVED[-1].log == ["lifecycle-drain", "stop"]
