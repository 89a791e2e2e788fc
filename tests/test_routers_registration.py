"""Registration with several routers, restarts and drains, one component at a time (no
subprocesses): `Registrations` keeps one registration per router, each failing on its own;
the registry tells a restart (a new `instance_id` at a known address) from a re-registration;
a drain tells the routers at once and waits for held leases; the settings' router list."""

from __future__ import annotations

import asyncio

import pytest

from common.roles import Role
from common.server.lifecycle import ServerLifecycle
from common.server.registrar import Registrations
from common.settings.base import WorkerSettings
from common.settings.schema import SettingsError
from epd.v1 import registry_service_pb2
from router.registry import Registry
from router.workers import WorkerRecord
from tests.cluster import free_port
from tests.registry_helpers import MODEL, info
from tests.test_pools import recorded as recorded  # the fakes' shared log (a fixture)
from tests.test_registrar import FakeRegistry, _info, _start_registry, _until
from tests.test_router import Cluster as RouterCluster
from tests.test_router import FakePrefill
from tests.test_router import ckpt as ckpt  # fixtures: a router with fake workers
from tests.test_router import cluster as cluster
from tests.test_router import worker_info as router_worker_info


async def test_one_registration_per_router_each_on_its_own() -> None:
    fakes = [FakeRegistry(), FakeRegistry()]
    routers = [await _start_registry(f) for f in fakes]
    down = f"127.0.0.1:{free_port()}"  # a router that is not (yet) there
    draining = False

    def load() -> registry_service_pb2.WorkerLoad:
        return registry_service_pb2.WorkerLoad(draining=draining)

    addresses = [routers[0].address, down, routers[1].address, routers[0].address]
    registrations = Registrations(addresses, _info(), load, retry_initial_s=0.01)
    try:
        assert registrations.router_addresses == [routers[0].address, down, routers[1].address]
        registrations.start()
        first, _, second = registrations.registrars
        assert await first.wait_registered(5) == "w1" and await second.wait_registered(5) == "w1"
        assert [len(f.registered) for f in fakes] == [1, 1]
        with pytest.raises(TimeoutError):
            await registrations.wait_registered(0.2)  # the missing router holds it up
        fakes[0].known.clear()  # router 0 forgot the worker: only that one registers again
        await _until(lambda: first.registrations == 2)
        assert second.registrations == 1
        draining = True
        assert await registrations.heartbeat_now() == 2  # the two routers that answer
        assert all(f.loads[-1].draining for f in fakes)
    finally:
        await registrations.stop()
        for router in routers:
            await router.stop(0)


def _restarts(registry: Registry) -> list[WorkerRecord]:
    heard: list[WorkerRecord] = []
    registry.on_restart.append(heard.append)
    return heard


def prefill(port: int, instance_id: str = "") -> registry_service_pb2.WorkerInfo:
    msg = info(Role.PREFILL, port)
    msg.instance_id = instance_id
    return msg


def test_a_new_instance_at_a_known_address_is_a_restart() -> None:
    registry = Registry(worker_timeout_s=3.0, heartbeat_interval_s=1.0, expected_model=MODEL)
    heard = _restarts(registry)
    first = registry.register(prefill(7001, "a"))
    again = registry.register(prefill(7001, "a"))  # router forgot it
    assert heard == [] and again.worker_id != first.worker_id
    restarted = registry.register(prefill(7001, "b"))
    assert [r.worker_id for r in heard] == [again.worker_id]
    assert [w.worker_id for w in registry.workers()] == [restarted.worker_id]
    registry.register(prefill(7001))  # no instance id: counted as a restart
    assert len(heard) == 2
    registry.register(prefill(7002, "b"))  # another address
    assert len(heard) == 2


async def test_drain_tells_routers_then_waits_for_held_leases() -> None:
    lifecycle = ServerLifecycle()
    told: list[int] = []
    leases = {"lease-1"}

    async def tell() -> None:
        told.append(len(leases))

    lifecycle.on_drain.append(tell)
    lifecycle.holds.append(leases.__len__)
    asyncio.get_running_loop().call_later(0.2, leases.clear)
    assert await lifecycle.drain(timeout_s=5) is True
    assert told == [1] and not leases and lifecycle.draining
    held = ServerLifecycle()
    held.holds.append(lambda: 1)  # never released: the bound ends the drain
    assert await held.drain(timeout_s=0.2) is False


def test_routers_setting_lists_every_router_once() -> None:
    assert WorkerSettings().routers == ()
    assert WorkerSettings(router_address="a:1").routers == ("a:1",)
    both = WorkerSettings(router_address="a:1", router_addresses=("b:2", "a:1", "c:3"))
    assert both.routers == ("a:1", "b:2", "c:3")
    both.check()
    with pytest.raises(SettingsError, match=r"router_addresses: 'b' is not an address \(host:port"):
        WorkerSettings(router_addresses=("b",)).check()
    with pytest.raises(SettingsError, match="router_address: "):
        WorkerSettings(router_address="nope").check()
    # gRPC took a port past 65535 modulo 65536: 116348 registered with another router.
    for bad in ("127.0.0.1:116348", "127.0.0.1:0", "127.0.0.1:"):
        with pytest.raises(SettingsError, match="port 1-65535"):
            WorkerSettings(router_address=bad).check()
    from common.settings.schema import from_mapping

    listed = from_mapping(WorkerSettings, {"router_addresses": "a:1, b:2,"})  # as a flag gives
    assert listed.routers == ("a:1", "b:2")


def test_advertise_address_is_one_the_routers_take() -> None:
    # One without a port started, and every router refused it at each registration.
    with pytest.raises(SettingsError, match=r"advertise_address: '10\.0\.0\.5' is not an address"):
        WorkerSettings(advertise_address="10.0.0.5").check()
    # `$(POD_IP):50062` on an IPv6 pod: put in brackets, as the registry takes it.
    v6 = WorkerSettings(advertise_address="fd00::1:50062")
    v6.check()
    assert v6.reachable_address("0.0.0.0:50062") == "[fd00::1]:50062"
    assert WorkerSettings(advertise_address="10.0.0.5:1").reachable_address("x") == "10.0.0.5:1"
    for portless in ("fd00::1", "::1"):  # was taken for `[fd00:]:1`, `[:]:1`
        with pytest.raises(SettingsError, match="advertise_address"):
            WorkerSettings(advertise_address=portless).check()


# ------------------------------------------------------------------- epd serve --routers N


def test_serve_routers_flag_and_consecutive_ports() -> None:
    from cluster.cli import build_parser, load_settings
    from router.settings import RouterSettings

    settings = load_settings(build_parser().parse_args(["serve", "--routers", "3"]))
    assert settings.pools.routers == 3
    with pytest.raises(SettingsError, match=r"pools\.routers: must be at least 1"):
        load_settings(build_parser().parse_args(["serve", "--routers", "0"])).check()
    base = RouterSettings(port=50051, http_port=8000, metrics_port=9400)
    assert [(r.port, r.http_port, r.metrics_port) for r in map(base.nth, range(3))] == [
        (50051, 8000, 9400),
        (50052, 8001, 9401),  # a fixed metrics port was every router's: the second failed
        (50053, 8002, 9402),
    ]
    free = RouterSettings(port=0, http_port=-1).nth(2)
    assert (free.port, free.http_port, free.metrics_port) == (0, -1, None)


async def test_pool_workers_register_with_every_router_and_drain_at_each(
    recorded: list[str],
) -> None:
    from cluster.pools import PoolManager
    from cluster.settings import EpdSettings
    from tests.test_pools import FakeActorClass

    actors = FakeActorClass(recorded)
    settings = EpdSettings()
    manager = PoolManager(
        settings.role_settings(),
        settings.pools,
        router_address="127.0.0.1:50051",
        router_addresses=["127.0.0.1:50052"],
        worker_host="127.0.0.1",
        namespace="epd-test",
        log_level="warning",
        cluster_gpus=0,
        actor_class=actors,
    )
    await manager.scale("decode", 1)
    manager.registered.add("epd-decode-0")  # (one that never registered is stopped at once)
    assert actors.handles[0].settings.routers == ("127.0.0.1:50051", "127.0.0.1:50052")
    await manager.scale("decode", 0)
    await manager.stop()
    drained = sorted(line for line in recorded if line.startswith("router-drain"))
    assert len(drained) == 2  # the retiring worker is drained at both routers


async def test_routers_found_through_dns_are_registered_with_and_let_go() -> None:
    fake = FakeRegistry()
    router = await _start_registry(fake)
    port = router.address.rsplit(":", 1)[1]
    found = Registrations(
        [], _info(), registry_service_pb2.WorkerLoad, discover=f"localhost:{port}", resolve_s=0.05
    )
    listed = Registrations(["10.9.9.9:1"], _info(), registry_service_pb2.WorkerLoad)
    try:
        found.start()
        await _until(lambda: len(fake.registered) == 1)
        assert f"127.0.0.1:{port}" in found.router_addresses
        await asyncio.sleep(0.2)  # lookups again: no second registration
        assert len(fake.registered) == 1
        await listed.track(["10.9.9.8:1"])  # discovered one more
        assert listed.router_addresses == ["10.9.9.9:1", "10.9.9.8:1"]
        await listed.track([])  # it left the answer; the listed router stays
        assert listed.router_addresses == ["10.9.9.9:1"]
    finally:
        await found.stop()
        await listed.stop()
        await router.stop(0)
    with pytest.raises(SettingsError, match=r"router_dns: 'x' is not an address \(host:port"):
        WorkerSettings(router_dns="x").check()


# ------------------------------------------------- a restart at the router (in-process fakes)


async def test_router_drops_a_restarted_workers_prefix_entries_and_channel(
    cluster: RouterCluster,
) -> None:
    old = FakePrefill()  # still streaming its KV events, as across a partition
    old.cached = [bytes([i]) * 32 for i in range(3)]
    address = await cluster.add(Role.PREFILL, old)
    router = cluster.router
    prefix, channels = router.orchestrator.prefix, router.orchestrator.channels

    async def register(instance_id: str) -> None:
        worker = router_worker_info(Role.PREFILL, address)
        worker.instance_id = instance_id
        await cluster.registry_stub.Register(registry_service_pb2.RegisterRequest(worker=worker))

    await register("first")
    await _until(lambda: prefix.cached_prefix(address, old.cached) == 3)
    before = channels.get(address)
    await register("first")  # the same process again (it lost the router for a moment)
    await asyncio.sleep(0.2)
    assert prefix.cached_prefix(address, old.cached) == 3 and channels.get(address) is before
    old.cached = []  # what the new process holds: nothing
    await register("second")  # a new process at the address: nothing of the old one stays
    assert channels.get(address) is not before  # dialled afresh
    await _until(lambda: prefix.cached_prefix(address, [bytes([0]) * 32]) == 0)
    await asyncio.sleep(0.2)  # the old stream is gone: no stale event comes back
    assert prefix.cached_prefix(address, [bytes([0]) * 32]) == 0


async def test_a_worker_is_ready_only_once_a_router_has_accepted_it() -> None:
    # It said SERVING from its start: a pod no router takes (a rotated token, another
    # model) looked Ready, and a rolling update swapped out every healthy pod for it.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.server.role import RoleServer
    from common.server.rpc import LIVENESS_SERVICE, channel
    from common.settings.security import SecuritySettings

    settings = WorkerSettings(port=0, security=SecuritySettings(insecure=True))
    server: RoleServer[object] = await RoleServer.start(
        settings, object(), lambda servicer, s: None, ["epd.v1.Test"], lifecycle=ServerLifecycle()
    )
    port = free_port()
    fake = FakeRegistry()
    router = None
    try:
        server.register(f"127.0.0.1:{port}", _info(), registry_service_pb2.WorkerLoad)
        async with channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def status(service: str = "") -> int:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                return int(reply.status)

            serving = health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.2)
            assert await status() != serving and await status("epd.v1.Test") != serving
            assert await status(LIVENESS_SERVICE) == serving  # alive: not restarted for it
            router = await _start_registry(fake, port)  # the router comes up
            for _ in range(100):
                if await status() == serving:
                    break
                await asyncio.sleep(0.05)
            assert await status() == serving and fake.registered
    finally:
        await server.stop(0)
        if router is not None:
            await router.stop(0)


async def test_a_stop_while_a_left_router_is_let_go_closes_its_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The worker stops just as its lookup finds a router gone: the stop cancelled the let-go
    # registrar's own stop, which `registrars` no longer listed, its channel left open
    # (races review L3, s45).
    import common.server.registrar as registrar_module

    answers = [[f"127.0.0.1:{free_port()}"], []]  # found, then gone (nobody listens there)
    stopping: list[asyncio.Future[None]] = []

    async def resolve_all(host: str, port: int) -> list[str]:
        found = answers.pop(0) if answers else []
        if not answers and not stopping:  # gone: the worker's stop runs next
            loop = asyncio.get_running_loop()
            loop.call_soon(lambda: stopping.append(asyncio.ensure_future(regs.stop())))
        return found

    monkeypatch.setattr(registrar_module, "resolve_all", resolve_all)
    worker = registry_service_pb2.WorkerInfo(address="127.0.0.1:1", name="w")
    load = registry_service_pb2.WorkerLoad
    regs = Registrations([], worker, load, discover="routers:1", resolve_s=0.2)
    regs.start()
    await _until(lambda: len(regs.registrars) == 1)
    (let_go,) = regs.registrars
    await _until(lambda: bool(stopping))
    await asyncio.gather(*stopping)
    assert let_go._channel is None
