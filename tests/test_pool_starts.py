"""A worker actor whose start raised (Ray does not restart an actor whose creation task
failed): it leaves its pool, its cause is told (`PoolManager.failures`, which AdminService
Status, `epd scale`, `epd status` and `epd serve`'s start-up report), and scaling again
starts another; one that died while starting stays, for Ray to restart. Over the stand-in
actors of `tests.test_pools` (no Ray)."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorUnavailableError, RayActorError

import cluster.pools as pools
from cluster.actor_states import ActorStates, WorkerStartError, actor_states
from cluster.deployment import Controller, _Scaler
from cluster.placement import CpuPlanner
from cluster.worker import WorkerDescription
from common.server.credentials import NO_CREDENTIALS
from tests.test_pools import _manager
from tests.test_pools import recorded as recorded  # fixture: what the fakes did

CAUSE = "SettingsError: prefill port 127.0.0.1:47220 is in use; set port to a free one"
RAISED = RayActorError(
    error_msg="The actor died because of an error raised in its creation task, "
    f"ray::epd-prefill-1:WorkerActor.__init__() (pid=1, ip=127.0.0.1)\n  File ...\n{CAUSE}",
    actor_init_failed=True,
)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_worker_whose_start_raised_leaves_its_pool_and_scaling_again_replaces_it(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It stayed a member that never served: `epd scale` to the same size started none, and
    # only `epd serve`'s console said why (walkthrough review, s39).
    manager, actors = _manager(recorded)
    released: list[str] = []
    monkeypatch.setattr(CpuPlanner, "release", lambda planner, name: released.append(name))
    await manager.scale("prefill", 1)
    await manager.scale("prefill", 2)
    actors.handles[-1].start_error = RAISED
    await settle()
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-0"]
    assert manager.failures() == [f"epd-prefill-1 failed to start: {CAUSE}"]
    assert "kill epd-prefill-1 True" in recorded and released == ["epd-prefill-1"]
    scaler = _Scaler(SimpleNamespace(pools=manager))  # type: ignore[arg-type]
    assert await scaler.failed() == manager.failures()  # what Status reports
    assert await manager.scale("prefill", 2) == 2  # again: another, and the failure is past
    await settle()
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-0", "epd-prefill-2"]
    assert manager.failures() == []


async def test_a_worker_unreachable_while_starting_is_asked_again_and_one_dead_is_failed(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ray's call waits through the restarts an actor has left: one that died while starting
    # and answers ActorDiedError is dead for good (past `max_restarts`), and was watched
    # forever while `epd serve` said "the rest load their model" (ownfixG review).
    monkeypatch.setattr(pools, "START_RETRY_S", 0.01)
    manager, actors = _manager(recorded)
    await manager.scale("decode", 2)
    actors.handles[0].start_error = ActorUnavailableError("connection lost", None)
    actors.handles[1].start_error = RayActorError(
        error_msg="The actor died unexpectedly before finishing this task.\n"
        "\tname: epd-decode-1\nThe actor is dead because its worker process has died.",
        actor_init_failed=False,
    )
    await asyncio.sleep(0.05)
    actors.handles[0].start_error = None  # reachable again, and up
    await asyncio.sleep(0.05)
    assert [name for name, _ in manager.members("decode")] == ["epd-decode-0"]
    assert manager.failures() == [
        "epd-decode-1 failed to start: it died while starting, past its restarts: "
        "The actor is dead because its worker process has died."
    ]
    assert [line for line in recorded if line.startswith("kill")] == ["kill epd-decode-1 True"]
    assert not manager._starting  # every watch ended


async def test_a_worker_retired_while_starting_is_no_failed_start(recorded: list[str]) -> None:
    # Its watch sees the actor killed (dead for good) after the retirement took it out of
    # the pool: nothing failed, and the retirement, not the watch, ends it.
    manager, actors = _manager(recorded)
    await manager.scale("encoder", 1)
    ready = asyncio.get_running_loop().create_future()
    actors.handles[0].__ray_ready__.fn = lambda: ready
    await settle()
    await manager.scale("encoder", 0)  # never registered: killed at once
    ready.set_exception(RayActorError(error_msg="killed", actor_init_failed=False))
    await settle()
    assert manager.failures() == [] and not manager._starting
    assert [line for line in recorded if line.startswith("kill")] == ["kill epd-encoder-0 True"]


async def test_epd_serve_start_up_ends_at_a_failed_start(recorded: list[str]) -> None:
    manager, actors = _manager(recorded)
    await manager.scale("prefill", 2)
    actors.handles[-1].start_error = RAISED
    await settle()
    controller = Controller.__new__(Controller)  # its fields, not its actor's start
    controller.pools = manager
    controller.router = SimpleNamespace(registry=SimpleNamespace(refusals={}))
    controller.router_address = "127.0.0.1:1"
    controller.credentials = NO_CREDENTIALS
    with pytest.raises(WorkerStartError, match=f"epd-prefill-1 failed to start: {CAUSE}"):
        await controller.wait_ready(10)


RESTART_RAISED = RayActorError(
    error_msg="The actor died because of an error raised in its creation task, "
    f"ray::epd-prefill-0:WorkerActor.__init__() (pid=2, ip=127.0.0.1)\n  File ...\n{CAUSE}",
    actor_init_failed=True,
)
CRASHED = RayActorError(
    error_msg="The actor died unexpectedly before finishing this task.\n"
    "The actor is dead because its worker process has died.",
    actor_init_failed=False,
)


async def test_a_worker_dead_for_good_after_it_started_leaves_its_pool(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Started, served, crashed; Ray's restart raised (its fixed port still taken), or it
    # crashed past its restarts: it stayed a member for good, `epd scale` to the same size
    # started none, and no line said why (s39diff review F1).
    manager, actors = _manager(recorded)
    retired: list[tuple[str, bool]] = []
    manager.retiring = lambda name, died: retired.append((name, died))  # held out at once
    await manager.scale("prefill", 2)
    await settle()  # both started
    dead = {"id-epd-prefill-0"}
    states = lambda ids: ActorStates(dead=frozenset(dead) & set(ids))  # noqa: E731
    monkeypatch.setattr(pools, "actor_states", states)
    monkeypatch.setattr("ray.available_resources", dict)
    actors.handles[0].start_error = RESTART_RAISED  # what a call on it raises now
    assert await manager.survey() == []
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-1"]
    assert manager.failures() == [f"epd-prefill-0 failed to restart: {CAUSE}"]
    assert "kill epd-prefill-0 True" in recorded
    # Scaling to the same size replaces the next one found dead, before it counts the pool.
    dead.add("id-epd-prefill-1")
    actors.handles[1].start_error = CRASHED
    assert await manager.scale("prefill", 2) == 2
    await settle()
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-2", "epd-prefill-3"]
    assert manager.failures() == [  # the one found by this scale, told until the next
        "epd-prefill-1 died for good: The actor is dead because its worker process has died."
    ]
    # The one found dead by survey, past its restarts since it started:
    dead.add("id-epd-prefill-3")
    actors.handles[3].start_error = CRASHED
    await manager.survey()
    assert manager.failures()[1:] == [  # beside the one before, until the next scale
        "epd-prefill-3 died for good: The actor is dead because its worker process has died."
    ]
    assert retired == [(f"epd-prefill-{n}", True) for n in (0, 1, 3)]  # counted by none
    # What a scale replaced (for `epd scale`): the failures before it and those it found.
    dead.add("id-epd-prefill-2")
    actors.handles[2].start_error = CRASHED
    assert await manager.scale("prefill", 2) == 2
    assert [line.split(" ")[0] for line in manager.replaced("prefill")] == [
        "epd-prefill-1",
        "epd-prefill-3",
        "epd-prefill-2",
    ]


async def test_a_scale_down_retires_the_dead_not_a_healthy_worker(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Scaled 3 -> 2 with one dead since the last survey, the newest healthy one was retired
    # and the dead one kept: one left of two asked (ownfixA review P1).
    manager, actors = _manager(recorded)
    await manager.scale("prefill", 3)
    await settle()
    monkeypatch.setattr(pools, "actor_states", lambda ids: ActorStates(dead=frozenset(ids[:1])))
    actors.handles[0].start_error = RESTART_RAISED
    assert await manager.scale("prefill", 2) == 2
    await settle()
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-1", "epd-prefill-2"]


async def test_no_worker_is_started_once_the_pools_stop(recorded: list[str]) -> None:
    # A Scale that reached the pools during `stop` started workers nobody retired (ownfixA
    # review P2).
    manager, _ = _manager(recorded)
    await manager.scale("encoder", 1)
    await manager.stop(routers_drained=True)
    with pytest.raises(ValueError, match="stopping"):
        await manager.scale("encoder", 2)
    assert manager.members("encoder") == []


async def test_a_dead_worker_still_starting_is_told_by_its_start_watch_alone(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, actors = _manager(recorded)
    await manager.scale("decode", 1)
    never = asyncio.get_running_loop().create_future()
    actors.handles[0].__ray_ready__.fn = lambda: never  # its start watch waits
    await settle()
    monkeypatch.setattr(pools, "actor_states", lambda ids: ActorStates(dead=frozenset(ids)))
    monkeypatch.setattr("ray.available_resources", dict)
    assert await manager.survey() == [] and manager.failures() == []
    never.set_exception(CRASHED)
    await settle()
    assert manager.failures() == [
        "epd-decode-0 failed to start: it died while starting, past its restarts: "
        "The actor is dead because its worker process has died."
    ]


def test_ray_is_asked_about_each_actor_by_its_id_not_its_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ray's actor table has no namespace: by name, another deployment's crash-looping
    # "epd-prefill-0" was told as this one's (s39diff review F2).
    import ray._private.state as state

    table = {
        "a1": {"State": "PENDING_CREATION", "NumRestarts": 0, "Pid": 0, "Address": {}},
        "a2": {"State": "RESTARTING", "NumRestarts": 4},
        "a3": {"State": "DEAD", "NumRestarts": 1},
        "a4": {"State": "PENDING_CREATION", "NumRestarts": 2, "Pid": 7},  # loading again
        "a5": {"State": "ALIVE", "NumRestarts": 3},
    }
    asked: list[str | None] = []

    def actors(actor_id: str | None = None, **_: object) -> dict[str, object]:
        asked.append(actor_id)
        return table.get(actor_id or "", {})

    monkeypatch.setattr(state, "actors", actors)
    got = actor_states(["a1", "a2", "a3", "a4", "a5", "unknown"])
    assert asked == ["a1", "a2", "a3", "a4", "a5", "unknown"]  # each by its id, no table scan
    assert got == ActorStates(frozenset({"a1"}), {"a2": 4, "a4": 2}, frozenset({"a3"}))


async def test_stop_ends_the_watches_of_workers_still_starting(recorded: list[str]) -> None:
    manager, actors = _manager(recorded)
    await manager.scale("encoder", 1)
    never = asyncio.get_running_loop().create_future()
    actors.handles[-1].__ray_ready__.fn = lambda: never  # Ray has not placed it
    await settle()
    await manager.stop(routers_drained=True)
    await settle()
    assert not manager._starting


async def test_epd_serve_start_up_names_a_worker_that_cannot_register(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "the rest load their model" for 600 s while a worker's every call to the router
    # failed its TLS handshake; only the worker's log said so (walkthrough review, s39).
    manager, actors = _manager(recorded)

    async def placed() -> list[str]:  # Ray placed them all
        return []

    monkeypatch.setattr(manager, "survey", placed)
    await manager.scale("prefill", 1)
    await manager.scale("decode", 1)
    refused = "127.0.0.1:1: UNAVAILABLE: Ssl handshake failed: CERTIFICATE_VERIFY_FAILED"

    async def failing() -> WorkerDescription:
        return WorkerDescription("prefill", "epd-prefill-0", "addr", 1, (refused,))

    def loading() -> asyncio.Future[WorkerDescription]:  # answers once loaded: not yet
        return asyncio.get_running_loop().create_future()

    actors.handles[0].describe.fn = failing
    actors.handles[1].describe.fn = loading
    await manager.scale("prefill", 2)  # another, failing alike: named on the same line
    actors.handles[2].describe.fn = failing
    await settle()  # their actors started: asked (one still starting is not: Ray queues it)
    controller = Controller.__new__(Controller)
    controller.pools = manager
    controller.registered = {}
    progress = await asyncio.wait_for(controller.progress(), 5)
    assert progress == (
        "0 of 3 workers registered (encoder 0/0, prefill 0/2, decode 0/1); "
        f"epd-prefill-0, epd-prefill-1 cannot register: {refused}"
    )
    actors.handles[0].describe.fn = actors.handles[2].describe.fn = loading
    assert (await controller.progress()).endswith("; the rest load their model")


async def test_epd_serve_stopped_while_waiting_leaves_no_unretrieved_failure() -> None:
    # Stopped during start-up, the controller's wait failed later, unread: asyncio printed
    # "Task exception was never retrieved" with a worker's "failed to start" (raypools
    # review, s39), as though one had.
    from cluster.deployment import Deployment

    unretrieved: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))

    async def fails_later() -> dict[str, int]:
        await asyncio.sleep(0.2)
        raise WorkerStartError("epd-encoder-0 failed to start: cancelled before it ran")

    deployment = Deployment.__new__(Deployment)  # its fields, not Ray's
    deployment.controller = SimpleNamespace(
        wait_ready=SimpleNamespace(remote=lambda timeout_s: fails_later())
    )
    waiting = asyncio.ensure_future(deployment.wait_ready(10))
    await asyncio.sleep(0.05)
    waiting.cancel()  # SIGTERM
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.3)
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []
