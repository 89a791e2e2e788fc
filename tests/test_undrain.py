"""`epd drain` / `epd undrain` and the worker counts `epd scale` and `epd status` share, over
the router's real AdminService and Registry on 127.0.0.1 (no workers: records are
registered directly)."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial

import grpc
import pytest

from cluster.admin import (
    DRAINED_STAY,
    RoleCount,
    cmd_drain,
    cmd_status,
    cmd_undrain,
    role_counts,
)
from cluster.cli import build_parser
from cluster.scale import cmd_scale
from common.roles import Role
from common.server.rpc import channel, start_server
from common.settings.schema import SettingsError
from epd.v1 import admin_service_pb2, admin_service_pb2_grpc
from router.admin import AdminServicer
from router.registry import Registry
from router.workers import WorkerLoad, WorkerRecord
from tests.registry_helpers import MODEL, info

add_admin = admin_service_pb2_grpc.add_AdminServiceServicer_to_server


@pytest.fixture
async def admin() -> AsyncIterator[tuple[str, Registry, list[int]]]:
    """(router address, its registry, scale calls) with two prefill workers registered."""
    registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0, expected_model=MODEL)
    for port in (7001, 7002):
        registry.register(info(Role.PREFILL, port))
    scaled: list[int] = []

    async def scaler(role: Role, replicas: int) -> int:
        scaled.append(replicas)
        return replicas

    servicer = AdminServicer(registry, scaler)
    server = await start_server(
        [lambda s: admin_service_pb2_grpc.add_AdminServiceServicer_to_server(servicer, s)],
        host="127.0.0.1",
    )
    try:
        yield server.address, registry, scaled
    finally:
        await server.stop(0)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args([*argv])


async def test_undrain_routes_to_a_drained_worker_again(
    admin: tuple[str, Registry, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    address, registry, _ = admin
    worker = "127.0.0.1:7001"
    assert await cmd_drain(_args("drain", worker, "--address", address)) == 0
    assert registry.pick(Role.PREFILL).address == "127.0.0.1:7002"  # 7001 gets no new work
    assert await cmd_undrain(_args("undrain", worker, "--address", address)) == 0
    assert not any(w.draining for w in registry.workers())
    assert await cmd_undrain(_args("undrain", "127.0.0.1:1", "--address", address)) == 1
    out, err = capsys.readouterr()
    assert f"{worker}: serving (gets new work again)" in out
    assert "epd: no registered worker at 127.0.0.1:1" in err  # (stderr: s42 operator L4)


async def test_undrain_of_a_worker_away_lifts_its_drain_by_address_or_name(
    admin: tuple[str, Registry, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Drained, then killed: while it restarts it is not registered. Undrain by address did
    # lift the drain but said "no registered worker" and exited 1; by name it did nothing,
    # and the worker came back drained.
    address, registry, _ = admin
    for worker in ("127.0.0.1:7001", "prefill-7001"):
        assert await cmd_drain(_args("drain", worker, "--address", address)) == 0
        (record,) = [w for w in registry.workers() if w.address == "127.0.0.1:7001"]
        registry.remove(record.worker_id)  # killed; Ray restarts it
        assert await cmd_undrain(_args("undrain", worker, "--address", address)) == 0
        assert f"{worker}: not registered now; it gets new work when it registers again" in (
            capsys.readouterr().out
        )
        assert not registry.register(info(Role.PREFILL, 7001)).draining
    assert await cmd_undrain(_args("undrain", "prefill-7001", "--address", address)) == 0
    assert await cmd_undrain(_args("undrain", "prefill-9", "--address", address)) == 1
    assert "no registered worker named prefill-9" in capsys.readouterr().err


async def test_a_worker_draining_itself_stays_draining(
    admin: tuple[str, Registry, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    address, registry, _ = admin
    (record,) = [w for w in registry.workers() if w.address == "127.0.0.1:7002"]
    registry.drain(record.address)
    registry.heartbeat(record.worker_id, WorkerLoad(draining=True))  # retiring
    assert await cmd_undrain(_args("undrain", record.address, "--address", address)) == 1
    assert "still draining: the worker itself drains" in capsys.readouterr().out
    assert record.draining


async def test_undrain_of_a_retiring_worker_says_still_draining(
    admin: tuple[str, Registry, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    # A scale-down retires it; before the worker drains itself, only the router holds it
    # out: undrain said "serving" and routed new work to a worker being removed.
    address, registry, _ = admin
    registry.retire("prefill-7002")  # what the deployment's controller does first
    assert await cmd_undrain(_args("undrain", "prefill-7002", "--address", address)) == 1
    assert "still draining: the worker itself drains" in capsys.readouterr().out
    assert {registry.pick(Role.PREFILL).address for _ in range(3)} == {"127.0.0.1:7001"}


async def test_an_empty_worker_is_refused_and_never_matches_an_unnamed_one(
    admin: tuple[str, Registry, list[int]],
) -> None:
    # `epd drain ""` drained every worker registered without a name.
    address, registry, _ = admin
    unnamed = info(Role.PREFILL, 7003)
    unnamed.name = ""
    registry.register(unnamed)
    for command in (cmd_drain, cmd_undrain):
        for worker in ("", "  "):
            with pytest.raises(SettingsError, match=r"^WORKER: "):
                await command(_args(command.__name__[4:], worker, "--address", address))
    assert not any(w.draining for w in registry.workers())


async def test_status_and_scale_count_serving_and_draining_alike(
    admin: tuple[str, Registry, list[int]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address, registry, scaled = admin
    registry.drain("127.0.0.1:7001")
    assert await cmd_status(_args("status", "--address", address)) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "encoder 0 workers serving; prefill 1 worker serving, 1 draining; decode 0 workers serving"
    )
    # The pool keeps the drained worker: asking for 2 finds 1 serving and says why, at
    # once (it waited the whole timeout, 300 s by default: walkthrough review, s39).
    argv = ("scale", "--role", "prefill", "--replicas", "2", "--timeout", "60")
    started = time.monotonic()
    assert await cmd_scale(_args(*argv, "--address", address)) == 1
    assert time.monotonic() - started < 10
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "prefill: 1 worker serving, 1 draining -> 2 workers"
    assert out[1].startswith("prefill: 1 worker serving, 1 draining (")
    assert out[2] == f"  {DRAINED_STAY}" and "`epd undrain` it" in out[2]
    # A router from before `WorkerStatus.drained` tells no drained one: at the timeout the
    # hint still comes, hedged (ownfixG review).
    monkeypatch.setattr(WorkerRecord, "operator_drained", property(lambda record: False))
    short = ("scale", "--role", "prefill", "--replicas", "2", "--timeout", "0.3")
    assert await cmd_scale(_args(*short, "--address", address)) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"  {DRAINED_STAY} (if one is)"
    monkeypatch.undo()
    registry.undrain("127.0.0.1:7001")
    assert await cmd_scale(_args(*argv, "--address", address)) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("prefill: 2 workers serving (")
    assert scaled == [2, 2, 2]


async def test_only_an_operators_drain_counts_as_drained(
    admin: tuple[str, Registry, list[int]],
) -> None:
    # A retiring worker drains on its way out; one an operator drained stays in its pool.
    address, registry, _ = admin
    registry.drain("127.0.0.1:7001")
    registry.drain("127.0.0.1:7002")
    registry.retire("prefill-7002")
    async with channel(address) as ch:
        stub = admin_service_pb2_grpc.AdminServiceStub(ch)
        reply = await stub.Status(admin_service_pb2.StatusRequest())
    assert role_counts(reply)["prefill"] == RoleCount(serving=0, draining=2, drained=1)


def test_role_counts_of_a_status_reply() -> None:
    reply = admin_service_pb2.StatusResponse()
    for role, draining in ((2, False), (2, True), (3, False), (0, False)):
        reply.workers.add(draining=draining).info.role = role  # role 0: unknown, skipped
    counts = role_counts(reply)
    assert counts == {
        "encoder": RoleCount(0, 0),
        "prefill": RoleCount(1, 1),
        "decode": RoleCount(1, 0),
    }


def test_a_drained_worker_that_goes_silent_is_retired_not_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    registry = Registry(
        worker_timeout_s=3.0, heartbeat_interval_s=1.0, expected_model=MODEL, clock=lambda: now[0]
    )
    leaving = registry.register(info(Role.DECODE, 7001))
    dead = registry.register(info(Role.DECODE, 7002))
    registry.drain(leaving.address)  # what a scale-down does before the worker stops
    now[0] += 10
    with caplog.at_level("INFO", logger="router.registry"):
        assert len(registry.expire()) == 2
    levels = {r.getMessage(): r.levelname for r in caplog.records}
    assert levels[f"retired decode worker {leaving.shown} (drained, stopped)"] == "INFO"
    assert levels[f"dropped decode worker {dead.shown}: no heartbeat for 10.0 s"] == "WARNING"


async def test_scale_says_what_a_waiting_worker_waits_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0, expected_model=MODEL)
    registry.register(info(Role.DECODE, 7001))

    class Scaler:  # a scaler whose second worker Ray cannot place
        async def __call__(self, role: Role, replicas: int) -> int:
            return replicas

        async def waiting(self) -> list[str]:
            return ["epd-decode-1 waits for Ray resources: asks CPU 1, GPU 1; free: CPU 0, GPU 0"]

    servicer = AdminServicer(registry, Scaler())
    server = await start_server(
        [lambda s: admin_service_pb2_grpc.add_AdminServiceServicer_to_server(servicer, s)],
        host="127.0.0.1",
    )
    try:
        argv = ("scale", "--role", "decode", "--replicas", "2", "--timeout", "0.5")
        assert await cmd_scale(_args(*argv, "--address", server.address)) == 1
    finally:
        await server.stop(0)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "decode: epd-decode-1 waits for Ray resources: asks CPU 1, GPU 1; free: CPU 0, GPU 0"
    )
    assert out[2] == "decode: still 1 worker serving after 0s"


async def test_drain_and_undrain_reach_every_router_listed_by_address_or_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Each router keeps its own registry: a worker drained on the first router of
    # $EPD_ROUTER alone still got the other routers' new work.
    registries, servers = [], []
    for _ in range(2):
        registry = Registry(worker_timeout_s=60.0, heartbeat_interval_s=1.0, expected_model=MODEL)
        for port in (7001, 7002):
            registry.register(info(Role.PREFILL, port))
        servicer = AdminServicer(registry, None)
        servers.append(await start_server([partial(add_admin, servicer)], host="127.0.0.1"))
        registries.append(registry)
    routers = ",".join(s.address for s in servers)
    try:
        assert await cmd_drain(_args("drain", "prefill-7001", "--address", routers)) == 0
        for registry in registries:
            assert [w.address for w in registry.workers() if w.draining] == ["127.0.0.1:7001"]
        assert await cmd_undrain(_args("undrain", "127.0.0.1:7001", "--address", routers)) == 0
        assert not any(w.draining for r in registries for w in r.workers())
        assert await cmd_drain(_args("drain", "nobody", "--address", routers)) == 1
        assert not any(w.draining for r in registries for w in r.workers())  # nothing drained
        out, err = capsys.readouterr()
        assert out.count("prefill-7001 (127.0.0.1:7001): draining") == 2  # one line a router
        assert f"{servers[1].address}: no registered worker named nobody" in err
        # A router that is down is reported; the ones after it are told all the same.
        await servers[0].stop(0)
        assert await cmd_drain(_args("drain", "127.0.0.1:7002", "--address", routers)) == 1
        assert [w.address for w in registries[1].workers() if w.draining] == ["127.0.0.1:7002"]
        assert f"{servers[0].address}: not told: UNAVAILABLE" in capsys.readouterr().out
    finally:
        for server in servers:
            await server.stop(0)


async def test_an_admin_refusal_names_its_field(admin: tuple[str, Registry, list[int]]) -> None:
    # The field was in the text only: a client reading `epd-field` found none.
    address, _, _ = admin
    async with grpc.aio.insecure_channel(address) as channel:
        stub = admin_service_pb2_grpc.AdminServiceStub(channel)
        for call, field in (
            (stub.Undrain(admin_service_pb2.UndrainRequest()), "address"),
            (stub.Status(admin_service_pb2.StatusRequest(role=99)), "role"),  # type: ignore[arg-type]
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (refused.value.details() or "").startswith(f"{field}: ")
            assert ("epd-field", field) in tuple(refused.value.trailing_metadata() or ())


async def test_a_slow_scale_down_gets_no_undrain_hint(
    admin: tuple[str, Registry, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Its retiring worker still finishing its streams at --timeout: the hedged hint told to
    # `epd undrain` a retirement (ownfixH review, s39).
    address, registry, _ = admin
    asyncio.get_running_loop().call_later(0.15, registry.retire, "prefill-7002")
    argv = ("scale", "--role", "prefill", "--replicas", "1", "--timeout", "0.3")
    assert await cmd_scale(_args(*argv, "--address", address)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "prefill: still 1 worker serving, 1 draining after 0s", out
