"""Retirements in the pool manager against a real router registry (no Ray: the stand-in
actors of test_pools): which worker a scale-down retires once an operator's drained worker
restarted, the retiring worker's hold at the router, and a worker that never registered."""

from __future__ import annotations

import asyncio

from cluster.deployment import follow_registries
from common.roles import Role
from router.registry import Registry
from tests.registry_helpers import MODEL, info
from tests.test_pools import _manager, _Method
from tests.test_pools import recorded as recorded  # fixture: ray.kill and router drains logged


def _register(registry: Registry, port: int, name: str, instance: str) -> str:
    msg = info(Role.PREFILL, port)
    msg.name, msg.instance_id = name, instance
    return registry.register(msg).address


async def test_scale_down_retires_a_drained_worker_first_after_it_restarted(
    recorded: list[str],
) -> None:
    # `epd drain epd-prefill-0`, then Ray restarted that actor on a new port: it came back
    # serving, and a scale to 1 retired epd-prefill-1 instead.
    manager, _ = _manager(recorded)
    registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0, expected_model=MODEL)
    follow_registries(manager, [registry])
    await manager.scale("prefill", 2)
    drained = _register(registry, 7000, "epd-prefill-0", "process-1")
    _register(registry, 7001, "epd-prefill-1", "process-2")
    assert manager.registered == {"epd-prefill-0", "epd-prefill-1"}
    registry.drain(drained)
    restarted = _register(registry, 7002, "epd-prefill-0", "process-3")
    assert await manager.scale("prefill", 1) == 1
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-1"]
    # Retiring, it is out of rotation at once, and an undrain does not put it back.
    assert registry.undrain(restarted) == (True, False, False)
    assert [w.name for w in registry.workers() if not w.draining] == ["epd-prefill-1"]
    await manager.stop()


async def test_a_worker_that_never_registered_is_stopped_at_once(recorded: list[str]) -> None:
    # Created by one scale and retired by the next while still loading its model: its
    # retirement waited the whole drain timeout on describe(), holding its CPUs and GPUs.
    manager, actors = _manager(recorded)  # drain_timeout_s: 300 s
    await manager.scale("prefill", 2)
    manager.registered.add("epd-prefill-0")

    async def loading() -> None:
        await asyncio.sleep(3600)

    actors.handles[1].describe = _Method(loading)
    recorded.clear()
    assert await manager.scale("prefill", 1) == 1
    await asyncio.wait_for(asyncio.gather(*manager._retiring), 5)
    assert recorded == ["kill epd-prefill-1 True"]
    await manager.stop()


async def test_the_routers_stop_after_the_workers_retire_unless_their_drain_ran_out() -> None:
    # Stopped with their drain, every retiring worker logged a failed heartbeat (docsdrift,
    # s37); a drain out of time still stops them first (their streams cancelled), or each
    # worker's drain waited for those as long again (ownfix review A).
    from types import SimpleNamespace

    from cluster.deployment import Controller

    order: list[object] = []
    clean = [True, False]  # each drain's outcome, in turn

    async def drain(timeout_s: float, *, stop: bool) -> bool:
        order.append(("drain", stop))
        return clean.pop(0)

    async def stop_router(grace_s: float) -> None:
        order.append(("stop", grace_s))

    async def stop_pools(*, routers_drained: bool) -> None:
        order.append(("pools", routers_drained))

    controller = Controller.__new__(Controller)
    controller.settings = SimpleNamespace(pools=SimpleNamespace(drain_timeout_s=1.0))  # type: ignore[assignment]
    controller.router = SimpleNamespace(lifecycle=SimpleNamespace(drain=drain), stop=stop_router)
    controller.more_routers = []
    controller.pools = SimpleNamespace(stop=stop_pools)  # type: ignore[assignment]
    for first in ([], [("stop", 0)]):
        order.clear()
        await controller.shutdown()
        assert order == [("drain", False), *first, ("pools", True), ("stop", 0.5)]


async def test_a_dead_worker_is_held_out_at_the_router_as_dead(recorded: list[str]) -> None:
    # Held out like a retiree, its registration timing out was logged "retired (drained,
    # stopped)" (ownfixB review F5, s40).
    manager, _ = _manager(recorded)
    registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0, expected_model=MODEL)
    follow_registries(manager, [registry])
    await manager.scale("prefill", 2)
    _register(registry, 7000, "epd-prefill-0", "process-1")
    _register(registry, 7001, "epd-prefill-1", "process-2")
    manager.retiring("epd-prefill-0", True)  # what `_failed` does
    manager.retiring("epd-prefill-1", False)  # what a scale-down does
    died = {w.name: (w.draining, w.died) for w in registry.workers()}
    assert died == {"epd-prefill-0": (True, True), "epd-prefill-1": (True, False)}
    await manager.stop()
