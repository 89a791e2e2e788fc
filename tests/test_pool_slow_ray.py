"""The pools when Ray answers late or not at all (`cluster.pools.ASK_RAY_S`): no scale held,
no worker started once the deployment stops, nothing said of resources Ray did not tell; and
what `epd serve` says once a worker waits for Ray resources. Over the stand-in actors of
`tests.test_pools` (no Ray)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

import cluster.pools as pools
from cluster.actor_states import ActorStates
from cluster.deployment import Controller
from tests.test_pool_starts import settle
from tests.test_pools import _manager
from tests.test_pools import recorded as recorded  # fixture: what the fakes did


async def test_a_ray_that_does_not_answer_holds_no_scale(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reap runs under the pool's lock: a GCS that hung held every scale and `stop` with
    # it (ownfixB review F4).
    manager, _ = _manager(recorded)
    await manager.scale("prefill", 1)
    await settle()
    monkeypatch.setattr(pools, "ASK_RAY_S", 0.05)

    def hung(ids: list[str]) -> ActorStates:
        time.sleep(1)
        return ActorStates()

    monkeypatch.setattr(pools, "actor_states", hung)
    started = time.monotonic()
    assert await manager.scale("prefill", 2) == 2
    assert time.monotonic() - started < 0.9


async def test_a_scale_while_the_shutdown_drains_the_routers_is_refused(
    recorded: list[str],
) -> None:
    # `stopping` was set only once the routers had drained: a Scale meanwhile started
    # workers, which loaded and were retired (raypools2 review 2).
    from cluster.settings import EpdSettings

    manager, _ = _manager(recorded)
    refused: list[str] = []

    async def drain(timeout_s: float, stop: bool = True) -> bool:
        with pytest.raises(ValueError, match="stopping") as err:
            await manager.scale("encoder", 1)
        refused.append(str(err.value))
        return True

    async def stop(grace_s: float) -> None:
        pass

    controller = Controller.__new__(Controller)  # its fields, not its actor's start
    controller.pools, controller.settings = manager, EpdSettings()
    controller.router = SimpleNamespace(lifecycle=SimpleNamespace(drain=drain), stop=stop)
    controller.more_routers = []
    await controller.shutdown()
    assert refused == ["the deployment is stopping"] and manager.members("encoder") == []


async def test_a_scale_whose_ray_question_outlasts_the_shutdown_starting_starts_none(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `stopping` was checked before the reap's question to Ray (up to `ASK_RAY_S`) alone: a
    # Scale that asked meanwhile started its workers (s41 review F4).
    manager, _ = _manager(recorded)
    await manager.scale("prefill", 1)
    await settle()
    asking, answer = threading.Event(), threading.Event()

    def slow(ids: list[str]) -> ActorStates:
        asking.set()
        answer.wait(5)
        return ActorStates()

    monkeypatch.setattr(pools, "actor_states", slow)
    scaling = asyncio.create_task(manager.scale("prefill", 3))
    await asyncio.to_thread(asking.wait, 5)
    manager.stopping = True  # the deployment's shutdown begins
    answer.set()
    with pytest.raises(ValueError, match="stopping"):
        await scaling
    assert len(manager.members("prefill")) == 1


async def test_no_worker_is_said_to_wait_for_resources_ray_did_not_tell(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ray's free resources past `ASK_RAY_S` read as none free: "free: CPU 0, memory 0 MiB"
    # (s41 review F5).
    import ray

    monkeypatch.setattr(pools, "ASK_RAY_S", 0.1)
    manager, _ = _manager(recorded)
    await manager.scale("prefill", 1)
    ids = [pools.actor_id(h) for _, h in manager.members("prefill")]
    monkeypatch.setattr(pools, "actor_states", lambda _: ActorStates(unplaced=frozenset(ids)))

    def late() -> dict[str, float]:
        time.sleep(0.3)
        return {"CPU": 8.0}

    monkeypatch.setattr(ray, "available_resources", late)
    assert await manager.survey() == []
    await asyncio.sleep(0.3)  # the late answer leaves the pools' one Ray thread
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0})
    assert [line.split(" waits")[0] for line in await manager.survey()] == ["epd-prefill-0"]


async def test_epd_serve_says_once_what_sets_what_a_waiting_worker_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It waited `ready_timeout_s` on a 2-core node for a worker asking 1 CPU too many, the
    # line naming what it asked, not what sets it (newuser review, s41).
    import cluster.deployment as deployment_module
    from cluster.deployment import Deployment
    from cluster.hints import RAY_ASKS_HINT

    monkeypatch.setattr(deployment_module, "WAIT_REPORT_S", 0.02)

    async def ready(timeout_s: float) -> dict[str, int]:
        await asyncio.sleep(0.2)
        return {"decode": 1}

    async def progress() -> str:
        return "2 of 3 registered; epd-decode-0 waits for Ray resources: asks CPU 1; free: CPU 0"

    deployment = Deployment.__new__(Deployment)  # its fields, not Ray's
    deployment.controller = SimpleNamespace(
        wait_ready=SimpleNamespace(remote=ready), progress=SimpleNamespace(remote=progress)
    )
    said: list[str] = []
    assert await deployment.wait_ready(10, said.append) == {"decode": 1}
    assert said.count(f"  {RAY_ASKS_HINT}") == 1 and len(said) > 3
    assert said.index(f"  {RAY_ASKS_HINT}") == 1  # after the first line that names one
