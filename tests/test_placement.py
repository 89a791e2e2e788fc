"""Worker threads and CPU placement: the plan (`cluster.placement`), the pool manager asking
Ray for the planned CPUs, and a worker process applying its placement
(`common.server.threads`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

import cluster.pools as pools
from cluster.actor_states import ActorStates
from cluster.placement import CpuPlanner
from cluster.settings import EpdSettings, PoolSettings
from common.server.threads import CpuPlacement, available_cores, resolve
from common.settings.schema import SettingsError
from common.settings.security import SecuritySettings
from decode_worker.settings import DecodeSettings
from encoder_worker.settings import EncoderSettings
from prefill_worker.settings import PrefillSettings


def test_auto_threads_divide_the_node_and_pin_disjoint_cores() -> None:
    plan = CpuPlanner.for_cluster(tuple(range(8)), nodes=1, workers=4)
    taken = [plan.take(f"w{i}", 0) for i in range(4)]
    assert [p.threads for p, _ in taken] == [2, 2, 2, 2]
    assert [p.cores for p, _ in taken] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [cpus for _, cpus in taken] == [2.0] * 4  # Ray's request matches the threads
    # A fifth worker (scaled past the plan) finds no free core: it shares the node with one
    # thread, unpinned, and asks Ray for no CPU (all 8 are planned already).
    assert plan.take("w4", 0) == (CpuPlacement(1, None), 0.0)
    plan.release("w1")  # retired: its cores go to the next worker
    assert plan.take("w5", 0) == (CpuPlacement(2, (2, 3)), 2.0)


def test_scaled_past_the_plan_takes_the_free_cores_left() -> None:
    plan = CpuPlanner.for_cluster(tuple(range(7)), nodes=1, workers=3)  # 2 threads each
    taken = [plan.take(f"w{i}", 0) for i in range(5)]
    assert [p.cores for p, _ in taken] == [(0, 1), (2, 3), (4, 5), (6,), None]
    assert [p.threads for p, _ in taken] == [2, 2, 2, 1, 1]
    assert sum(cpus for _, cpus in taken) == 7.0  # fits a Ray of 7 CPUs


def test_more_workers_than_cores_share_the_node_unpinned() -> None:
    plan = CpuPlanner.for_cluster((0, 1), nodes=1, workers=3)
    taken = [plan.take(f"w{i}", 0) for i in range(5)]  # 3, then scaled to 5
    assert [p for p, _ in taken] == [CpuPlacement(1, None)] * 5
    assert [cpus for _, cpus in taken] == [0.0] * 5  # Ray places them all
    assert plan.take("w5", 2) == (CpuPlacement(2, None), 2.0)  # explicit threads: asked


def test_explicit_threads_and_num_cpus_win() -> None:
    plan = CpuPlanner.for_cluster(tuple(range(4)), nodes=1, workers=3)
    placement, cpus = plan.take("w0", 3)
    assert placement == CpuPlacement(3, (0, 1, 2)) and cpus == 3.0
    assert plan.take("w1", 2) == (CpuPlacement(2, None), 2.0)  # one core left: not pinned
    fixed = CpuPlanner.for_cluster(tuple(range(4)), nodes=1, workers=3, num_cpus=0.5)
    assert fixed.take("w0", 0)[1] == 0.5


def test_several_nodes_share_per_node_and_never_pin() -> None:
    plan = CpuPlanner.for_cluster(tuple(range(16)), nodes=2, workers=3)  # 2 per node
    placement, cpus = plan.take("w0", 0)
    assert placement == CpuPlacement(8, None) and cpus == 8.0


@pytest.mark.parametrize("cls", [EncoderSettings, PrefillSettings, DecodeSettings])
def test_threads_setting_is_checked(cls: Any) -> None:
    assert cls().threads == 0
    with pytest.raises(SettingsError, match=r"^threads: must not be negative"):
        cls(threads=-1, security=SecuritySettings(insecure=True)).check()
    with pytest.raises(SettingsError, match=r"^decode\.threads: must not be negative"):
        EpdSettings(decode=DecodeSettings(threads=-2)).check()
    with pytest.raises(SettingsError, match=r"^threads"):
        resolve(-1)


def test_alone_a_worker_takes_every_core() -> None:
    assert resolve(0) == CpuPlacement(len(available_cores()))
    assert resolve(3) == CpuPlacement(3)
    share = CpuPlacement(1, (0,))
    assert resolve(0, share) is share


async def test_pool_manager_asks_ray_for_the_planned_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_pools import FakeActorClass

    monkeypatch.setattr("ray.kill", lambda handle, no_restart=False: None)

    async def no_router(*args: Any) -> None:
        return None

    monkeypatch.setattr(pools, "drain_at_router", no_router)
    actors = FakeActorClass()
    settings = EpdSettings(decode=DecodeSettings(threads=2), pools=PoolSettings())
    manager = pools.PoolManager(
        settings.role_settings(),
        settings.pools,
        router_address="127.0.0.1:1",
        worker_host="127.0.0.1",
        namespace="t",
        log_level="warning",
        cluster_gpus=0,
        actor_class=actors,
        cpu=CpuPlanner.for_cluster(tuple(range(4)), nodes=1, workers=3),
    )
    await manager.scale("encoder", 1)
    await manager.scale("decode", 1)
    encoder, decode = actors.handles
    assert encoder.placement == CpuPlacement(1, (0,)) and encoder.options["num_cpus"] == 1.0
    assert decode.placement == CpuPlacement(2, (1, 2)) and decode.options["num_cpus"] == 2.0
    await manager.scale("decode", 0)
    await asyncio.gather(*manager._retiring)
    assert manager.cpu.take("next", 2)[0].cores == (1, 2)  # the retired worker's cores


def test_a_worker_process_applies_its_placement() -> None:
    cores = sorted(available_cores())
    pinned = (cores[-1],) if hasattr(os, "sched_setaffinity") else None
    code = (
        "import os, torch\n"
        "from common.server.threads import CpuPlacement, apply\n"
        f"apply(CpuPlacement(1, {pinned!r}))\n"
        "print(torch.get_num_threads(), torch.get_num_interop_threads(),\n"
        "      sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split(maxsplit=2)
    assert out[:2] == ["1", "1"]
    if pinned is not None:
        assert out[2].strip() == str(list(pinned))


@pytest.mark.skipif(len(available_cores()) < 2, reason="one core: no team to start")
def test_threads_running_torch_take_the_processs_thread_count() -> None:
    # A pull thread whose first torch call was a matrix product (a digest) started an
    # OpenMP team of a thread per core, spinning between calls (perf14 review, s43).
    code = (
        "import os, torch\n"
        "from common.kv_pull import _pulls\n"
        "from common.models.model_thread import ModelThread\n"
        "from prefill_worker.embeddings import _pulls as embeddings\n"
        "torch.set_num_threads(1)\n"
        "a = torch.randn(128, 128)\n"
        "def product():\n"
        "    before = len(os.listdir('/proc/self/task'))\n"
        "    a @ a\n"
        "    return len(os.listdir('/proc/self/task')) - before\n"
        "model = ModelThread()\n"
        "print([p.submit(product).result() for p in (_pulls, embeddings, model._executor)])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.split("\n")[-2] == "[0, 0, 0]", out


async def test_waiting_names_the_workers_ray_cannot_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_pools import FakeActorClass

    settings = EpdSettings(decode=DecodeSettings(threads=4), pools=PoolSettings())
    manager = pools.PoolManager(
        settings.role_settings(),
        settings.pools,
        router_address="127.0.0.1:1",
        worker_host="127.0.0.1",
        namespace="t",
        log_level="warning",
        cluster_gpus=0,
        actor_class=FakeActorClass(),
        cpu=CpuPlanner.for_cluster(tuple(range(4)), nodes=1, workers=2),
    )
    await manager.scale("encoder", 1)
    await manager.scale("decode", 1)
    # Ray has placed neither yet; 1 CPU is free: the encoder (2 CPUs asked) and the decode
    # worker (4) both wait for resources.
    unplaced = ActorStates(frozenset({"id-epd-encoder-0", "id-epd-decode-0"}))  # by actor id
    monkeypatch.setattr(pools, "actor_states", lambda ids: unplaced)
    gib = float(1 << 30)
    monkeypatch.setattr("ray.available_resources", lambda: {"CPU": 1.0, "memory": gib})
    assert await manager.survey() == [  # no "GPU 0" free for a worker that asks for none
        "epd-encoder-0 waits for Ray resources: asks CPU 2, memory 448 MiB; "
        "free: CPU 1, memory 1024 MiB",
        "epd-decode-0 waits for Ray resources: asks CPU 4, memory 448 MiB; "
        "free: CPU 1, memory 1024 MiB",
    ]
    monkeypatch.setattr("ray.available_resources", lambda: {"CPU": 2.0, "memory": gib})
    assert [line.split()[0] for line in await manager.survey()] == ["epd-decode-0"]  # 2 CPUs fit
    # Memory, too: 64 workers of about 400 MB each would have run 24 GB out of memory.
    monkeypatch.setattr("ray.available_resources", lambda: {"CPU": 8.0, "memory": gib / 4})
    assert [line.split()[0] for line in await manager.survey()] == ["epd-encoder-0", "epd-decode-0"]
    # Placed, and crashing as it starts: Ray restarts it (it was told as loading its model).
    monkeypatch.setattr("ray.available_resources", lambda: {"CPU": 8.0, "memory": gib})
    crashing = ActorStates(restarted={"id-epd-decode-0": 3})
    monkeypatch.setattr(pools, "actor_states", lambda ids: crashing)
    assert await manager.survey() == [
        "epd-decode-0 is restarting (restarted 3 times: its log says why)"
    ]
