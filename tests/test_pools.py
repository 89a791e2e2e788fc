"""The pool manager logic, without a Ray cluster.

Ray's part (placement, restarts) is exercised end to end in test_serve.py. Here the actor
class is a stand-in with the same `.options(...).remote(...)` / `handle.method.remote()`
shape, `ray.kill` is recorded, and the router side of a drain is a real gRPC AdminService
fake on 127.0.0.1, so the order of a retirement (router drain → wait for the router's
requests → worker drain → kill) and the settings each worker gets are checked exactly.
The worker actor itself is tested in test_worker_actor.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

import cluster.pools as pools
from cluster.admin import RoleCount, drain_at_router, role_counts
from cluster.pools import PoolManager
from cluster.settings import EpdSettings, PoolSettings
from cluster.worker import WorkerDescription
from common.server.rpc import start_server
from common.server.threads import CpuPlacement
from common.wire.roles import role_from_proto, role_to_proto
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc, registry_service_pb2
from prefill_worker.settings import PrefillSettings

# ------------------------------------------------------------------------ stand-in actors


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return asyncio.ensure_future(self.fn(*args))


@dataclass
class FakeHandle:
    """Records what the pool manager asks a worker actor to do."""

    name: str
    role: str
    settings: Any
    options: dict[str, Any]
    log: list[str]
    drain_clean: bool = True
    host: str | None = None  # the listen host the actor is told (None: its node's IP)
    placement: CpuPlacement | None = None  # threads and cores the actor is told
    start_error: BaseException | None = None  # what its start raises (None: it starts)

    def __post_init__(self) -> None:
        self.describe = _Method(self._describe)
        self.drain = _Method(self._drain)
        self.__ray_ready__ = _Method(self._ready)  # Ray's: returns once __init__ has
        self._actor_id = SimpleNamespace(hex=lambda: f"id-{self.name}")  # not its name

    async def _ready(self) -> None:
        if self.start_error is not None:
            raise self.start_error

    async def _describe(self) -> WorkerDescription:
        self.log.append(f"describe {self.name}")
        return WorkerDescription(self.role, self.name, f"addr-{self.name}", 1)

    async def _drain(self, timeout_s: float) -> bool:
        self.log.append(f"drain {self.name}")
        return self.drain_clean


@dataclass
class FakeActorClass:
    """`ray.remote(WorkerActor)` stand-in: `.options(**o).remote(*args)` makes a handle."""

    log: list[str] = field(default_factory=list)
    handles: list[FakeHandle] = field(default_factory=list)

    def options(self, **options: Any) -> Any:
        outer = self

        class _Bound:
            def remote(
                self,
                role: str,
                name: str,
                settings: Any,
                log_level: str,
                host: str | None,
                placement: CpuPlacement | None = None,
            ) -> FakeHandle:
                handle = FakeHandle(name, role, settings, options, outer.log)
                handle.host = host
                handle.placement = placement
                outer.handles.append(handle)
                outer.log.append(f"create {name}")
                return handle

        return _Bound()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The log shared by the fakes; `ray.kill` and the router drain append to it."""
    log: list[str] = []
    import ray

    monkeypatch.setattr(
        ray, "kill", lambda handle, no_restart=False: log.append(f"kill {handle.name} {no_restart}")
    )

    async def fake_router_drain(router: str, worker: str, timeout_s: float, creds: Any) -> None:
        log.append(f"router-drain {worker}")

    monkeypatch.setattr(pools, "drain_at_router", fake_router_drain)
    return log


def _manager(
    log: list[str], *, cluster_gpus: float = 0, **pool_settings: Any
) -> tuple[PoolManager, FakeActorClass]:
    actors = FakeActorClass(log)
    settings = EpdSettings(pools=PoolSettings(**pool_settings))
    manager = PoolManager(
        settings.role_settings(),
        settings.pools,
        router_address="127.0.0.1:50051",
        worker_host="127.0.0.1",
        namespace="epd-test",
        log_level="warning",
        cluster_gpus=cluster_gpus,
        actor_class=actors,
    )
    return manager, actors


# ----------------------------------------------------------------------------- the tests


def test_role_names_and_wire_values_round_trip() -> None:
    for role in ("encoder", "prefill", "decode"):
        assert role_from_proto(role_to_proto(role)) == role
    assert role_to_proto("prefill") == registry_service_pb2.WORKER_ROLE_PREFILL
    with pytest.raises(ValueError, match="unknown role 'router'"):
        role_to_proto("router")
    with pytest.raises(ValueError, match="worker role 0"):
        role_from_proto(0)


def test_error_summary_is_the_root_cause() -> None:
    ray_style = (
        "The actor died because of an error raised in its creation task\n"
        '  File "x.py", line 1, in serve\n'
        "cluster.pools.WorkerStartError: epd-prefill-0 failed to start: FileNotFoundError: /m\n"
    )
    assert pools.error_summary(RuntimeError(ray_style)) == (
        "epd-prefill-0 failed to start: FileNotFoundError: /m"
    )
    said = "common.settings.schema.SettingsError: port 127.0.0.1:1 is in use"
    assert pools.error_summary(RuntimeError(said)) == "SettingsError: port 127.0.0.1:1 is in use"
    assert pools.error_summary(RuntimeError("")) == "RuntimeError('')"
    reason = "the router refused a worker: decode worker"
    refused = RuntimeError(f"cluster.pools.WorkerRefusedError: {reason}")
    assert pools.error_summary(refused) == reason


async def test_scale_up_creates_named_actors_with_filled_in_settings(recorded: list[str]) -> None:
    manager, actors = _manager(recorded, num_cpus=0.5, max_restarts=7)
    assert await manager.scale("prefill", 3) == 3
    assert [h.name for h in actors.handles] == ["epd-prefill-0", "epd-prefill-1", "epd-prefill-2"]
    handle = actors.handles[0]
    assert handle.role == "prefill"
    assert handle.settings.router_address == "127.0.0.1:50051"
    assert handle.settings.name == "epd-prefill-0"
    assert handle.host == "127.0.0.1"
    assert handle.settings.device == "cpu"
    assert handle.options["num_cpus"] == 0.5 and handle.options["num_gpus"] == 0
    assert handle.options["memory"] == 448 << 20  # the tiny model's: no weights to add
    assert handle.options["max_restarts"] == 7
    assert handle.options["name"] == "epd-prefill-0" and handle.options["namespace"] == "epd-test"
    assert manager.replicas() == {"encoder": 0, "prefill": 3, "decode": 0}


async def test_gpu_clusters_get_cuda_workers(recorded: list[str]) -> None:
    manager, actors = _manager(recorded, cluster_gpus=8, num_gpus=0.5)
    await manager.scale("decode", 1)
    assert actors.handles[0].options["num_gpus"] == 0.5
    assert actors.handles[0].settings.device == "cuda"
    manager, actors = _manager(recorded, cluster_gpus=8, num_gpus=0)  # 0 GPUs: CPU workers
    await manager.scale("decode", 1)
    assert actors.handles[0].options["num_gpus"] == 0
    assert actors.handles[0].settings.device == "cpu"


@pytest.mark.parametrize(
    ("cluster_gpus", "num_gpus", "expected"),
    [
        (0, None, 0.0),  # CPU-only cluster: never ask for GPUs
        (0, 1.0, 0.0),
        (8, None, 1.0),  # enough GPUs for the 3 starting workers: one each
        (3, None, 1.0),
        (1, None, 0.33),  # one GPU shared by 3 workers
        (2, None, 0.66),
        (8, 2.0, 2.0),  # explicit wins
    ],
)
def test_gpus_per_worker(cluster_gpus: float, num_gpus: float | None, expected: float) -> None:
    assert PoolSettings(num_gpus=num_gpus).gpus_per_worker(cluster_gpus) == expected


async def test_scale_down_retires_newest_in_order_and_never_reuses_names(
    recorded: list[str],
) -> None:
    manager, actors = _manager(recorded)
    await manager.scale("prefill", 3)
    manager.registered |= {"epd-prefill-1", "epd-prefill-2"}  # (one that never did: killed)
    recorded.clear()
    assert await manager.scale("prefill", 1) == 1  # returns before the retirements finish
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-0"]
    await manager.scale("prefill", 2)
    assert actors.handles[-1].name == "epd-prefill-3"
    await manager.stop()  # waits for every retirement (and retires the others too)
    for name in ("epd-prefill-2", "epd-prefill-1"):
        steps = [e for e in recorded if e.split()[1] in (name, f"addr-{name}")]
        assert steps == [
            f"describe {name}",
            f"router-drain addr-{name}",
            f"drain {name}",
            f"kill {name} True",
        ]


async def test_scale_down_retires_the_workers_an_operator_drained_first(
    recorded: list[str],
) -> None:
    # `epd drain epd-prefill-0`, then a scale to 1 retired the newest, epd-prefill-1: the
    # pool kept its drained worker and served nothing, and `epd scale` said it was done.
    manager, _ = _manager(recorded)
    drained = {"epd-prefill-0"}
    retiring: list[str] = []
    manager.drained = drained.__contains__
    manager.retiring = lambda name, died: retiring.append(name + " (died)" * died)
    await manager.scale("prefill", 2)
    assert await manager.scale("prefill", 1) == 1
    assert [name for name, _ in manager.members("prefill")] == ["epd-prefill-1"]
    assert retiring == ["epd-prefill-0"]  # told before scale returns, not after a describe
    await manager.stop()


async def test_stop_after_the_router_is_gone_skips_the_router_drain(recorded: list[str]) -> None:
    manager, _ = _manager(recorded)
    await manager.scale("encoder", 3)
    manager.registered |= {"epd-encoder-0", "epd-encoder-1"}  # epd-encoder-2 still starts
    recorded.clear()
    await manager.stop(routers_drained=True)
    assert sorted(recorded) == [
        "drain epd-encoder-0",
        "drain epd-encoder-1",
        "kill epd-encoder-0 True",
        "kill epd-encoder-1 True",
        "kill epd-encoder-2 True",  # never registered: nothing to drain (Ctrl-C at start-up)
    ]
    assert manager.replicas() == {"encoder": 0, "prefill": 0, "decode": 0}


async def test_a_failed_drain_still_ends_the_actor(recorded: list[str]) -> None:
    manager, actors = _manager(recorded)
    await manager.scale("decode", 1)
    manager.registered.add("epd-decode-0")

    async def broken(timeout_s: float) -> bool:
        raise RuntimeError("actor died")

    actors.handles[0].drain = _Method(broken)
    await manager.stop()
    assert recorded[-1] == "kill epd-decode-0 True"


async def test_a_router_that_fails_its_drain_leaves_the_worker_drained_by_the_others(
    recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def one_router_down(router: str, worker: str, timeout_s: float, creds: Any) -> None:
        if router == "127.0.0.1:50052":
            raise ConnectionError("router unreachable")
        recorded.append(f"router-drain {worker} at {router}")

    monkeypatch.setattr(pools, "drain_at_router", one_router_down)
    manager, _ = _manager(recorded)
    manager.router_addresses = ("127.0.0.1:50052",)
    await manager.scale("prefill", 1)
    manager.registered.add("epd-prefill-0")
    recorded.clear()
    await manager.scale("prefill", 0)
    await asyncio.gather(*manager._retiring)
    # The other router drained it, and so did the worker itself, before the kill.
    assert recorded == [
        "describe epd-prefill-0",
        "router-drain addr-epd-prefill-0 at 127.0.0.1:50051",
        "drain epd-prefill-0",
        "kill epd-prefill-0 True",
    ]


async def test_scale_refuses_bad_requests(recorded: list[str]) -> None:
    manager, _ = _manager(recorded, max_replicas=4)
    with pytest.raises(ValueError, match="unknown role"):
        await manager.scale("router", 1)
    with pytest.raises(ValueError, match=r"replicas must be in \[0, 4\] \(\[pools\] max_replicas"):
        await manager.scale("decode", 5)
    # A fixed port takes one worker: refused at start, but `epd scale` to 2 started one
    # that failed "port in use" (operator2 review L7, s44).
    for key in ("port", "metrics_port"):
        fixed: Any = dataclasses.replace(PrefillSettings(), **{key: 45120})  # type: ignore[arg-type]
        settings = EpdSettings(prefill=fixed, pools=PoolSettings())
        manager.role_settings = settings.role_settings()
        assert await manager.scale("prefill", 1) == 1
        with pytest.raises(ValueError, match=rf"^prefill\.{key}: a fixed port takes one worker"):
            await manager.scale("prefill", 2)
        assert await manager.scale("prefill", 0) == 0


# ------------------------------------------------------------------ router side of drain


class FakeAdmin(admin_service_pb2_grpc.AdminServiceServicer):
    """Reports one worker whose router in-flight count drops by one per Status call."""

    def __init__(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self.drained: list[str] = []

    async def Status(self, request: Any, context: Any) -> admin_service_pb2.StatusResponse:
        response = admin_service_pb2.StatusResponse()
        response.workers.add(
            info=registry_service_pb2.WorkerInfo(
                role=registry_service_pb2.WORKER_ROLE_PREFILL, address="10.0.0.1:1"
            ),
            router_in_flight=self.in_flight,
            draining=bool(self.drained),
        )
        self.in_flight = max(0, self.in_flight - 1)
        return response

    async def Drain(self, request: Any, context: Any) -> admin_service_pb2.DrainResponse:
        self.drained.append(request.address)
        return admin_service_pb2.DrainResponse(found=True)


@pytest.fixture
async def fake_admin() -> AsyncIterator[tuple[str, FakeAdmin]]:
    admin = FakeAdmin(in_flight=3)
    server = await start_server(
        [lambda s: admin_service_pb2_grpc.add_AdminServiceServicer_to_server(admin, s)],
        host="127.0.0.1",
    )
    try:
        yield server.address, admin
    finally:
        await server.stop(0)


async def test_drain_at_router_waits_for_the_routers_requests(
    fake_admin: tuple[str, FakeAdmin],
) -> None:
    address, admin = fake_admin
    await drain_at_router(address, "10.0.0.1:1", timeout_s=10)
    assert admin.drained == ["10.0.0.1:1"]
    assert admin.in_flight == 0


async def test_registered_counts_leave_out_draining_workers(
    fake_admin: tuple[str, FakeAdmin],
) -> None:
    address, admin = fake_admin
    admin.drained.append("10.0.0.1:1")
    async with grpc.aio.insecure_channel(address) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        assert await pools.registered_counts(stub) == {"encoder": 0, "prefill": 0, "decode": 0}
        reply = await stub.Status(admin_service_pb2.StatusRequest())
        assert role_counts(reply)["prefill"] == RoleCount(serving=0, draining=1)


def test_each_worker_asks_ray_for_its_memory(tmp_path) -> None:
    # Nothing bounded a scale-up on CPU but max_replicas (64): workers past the cores ask
    # for no CPU, so Ray placed them all, about 400 MB each (pools review).
    from cluster.settings import BASE_WORKER_MB, PoolSettings

    (tmp_path / "model.safetensors").write_bytes(bytes(3 << 20))
    assert PoolSettings().memory_per_worker(str(tmp_path)) == (BASE_WORKER_MB + 3) << 20
    assert PoolSettings().memory_per_worker(None) == BASE_WORKER_MB << 20
    assert PoolSettings().memory_per_worker(str(tmp_path), "cuda") == BASE_WORKER_MB << 20
    assert PoolSettings(memory_mb=0).memory_per_worker(str(tmp_path)) == 0
    assert PoolSettings(memory_mb=100).memory_per_worker(None) == 100 << 20
