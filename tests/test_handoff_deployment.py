"""Prefill and decode workers as deployed, with the KV moving by real NIXL READs: a prefill
worker started as `python -m prefill_worker` in its own process serves a handoff that the
decode worker of the in-process `cluster` (tests/test_kv_handoff.py) pulls in full and
answers as the offline `Engine` does, and both workers register with a router (address,
name, KV layout, model, protocol version, the "nixl" capability) and heartbeat their free
and used KV blocks.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from common.kv.allocator import blocks_for
from common.roles import PROTOCOL_VERSION
from common.server.rpc import channel, start_server
from common.wire.kv import layout_to_proto
from decode_worker.server import serve as serve_decode
from decode_worker.settings import DecodeSettings
from epd.v1 import prefill_service_pb2_grpc, registry_service_pb2, registry_service_pb2_grpc
from prefill_worker.server import serve as serve_prefill
from prefill_worker.settings import PrefillSettings
from tests.cluster import cluster_credentials, cluster_security
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    Cluster,
    assert_same,
    ckpt,
    cluster,
    decode_request,
    engine,
    eventually,
    img_part,
    make_handoff,
    prefill_request,
    run_decode,
    user,
    vid_part,
)

__all__ = ["ckpt", "cluster", "engine"]  # module fixtures shared with test_kv_handoff

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
async def test_prefill_in_another_process(cluster: Cluster, ckpt: Path, tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "prefill_worker",
            f"--model={ckpt}",
            f"--block-size={BLOCK}",
            "--num-blocks=64",
            "--port=0",
            f"--security-cluster-token-file={cluster_security().cluster_token_file}",
            cwd=ROOT,
            stdout=out,
            stderr=out,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        address = None
        deadline = time.monotonic() + 120
        while address is None:
            assert proc.returncode is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            found = re.search(r"prefill worker (\S+) serving", log.read_text())
            address = found.group(1) if found else None
            await asyncio.sleep(0.1)
        messages = user(img_part(11), vid_part(12, 4), "Which came first?")
        tokens, params = make_handoff(cluster.engine, messages)
        async with channel(address, credentials=cluster_credentials()) as ch:
            stub = prefill_service_pb2_grpc.PrefillServiceStub(ch)
            reply = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=60)
            assert reply.kv.agent_name.startswith(f"prefill-{proc.pid}-")
            answer = await run_decode(cluster, decode_request(tokens, params, GREEDY, reply))
            assert_same(answer, cluster.expected(messages, GREEDY))
            assert answer.chunks[0].blocks_pulled == blocks_for(len(tokens), BLOCK)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, log.read_text()


class FakeRegistry(registry_service_pb2_grpc.RegistryServiceServicer):
    """Records registrations and heartbeats; asks for fast heartbeats."""

    def __init__(self) -> None:
        self.workers: list[registry_service_pb2.WorkerInfo] = []
        self.loads: list[registry_service_pb2.WorkerLoad] = []

    async def Register(
        self, request: registry_service_pb2.RegisterRequest, context: Any
    ) -> registry_service_pb2.RegisterResponse:
        self.workers.append(request.worker)
        return registry_service_pb2.RegisterResponse(
            worker_id=f"w{len(self.workers)}", heartbeat_interval_ms=50
        )

    async def Heartbeat(
        self, request: registry_service_pb2.HeartbeatRequest, context: Any
    ) -> registry_service_pb2.HeartbeatResponse:
        self.loads.append(request.load)
        return registry_service_pb2.HeartbeatResponse(known=True)


async def test_workers_register_their_layout_and_heartbeat(ckpt: Path) -> None:
    fake = FakeRegistry()
    router = await start_server(
        [lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(fake, s)]
    )
    common_kw: dict[str, Any] = {
        "model": str(ckpt),
        "block_size": BLOCK,
        "num_blocks": 32,
        "router_address": router.address,
        "security": cluster_security(),
    }
    prefill = await serve_prefill(PrefillSettings(name="p0", **common_kw))
    decode = await serve_decode(DecodeSettings(name="d0", **common_kw))
    try:
        await eventually(lambda: len(fake.workers) == 2 and len(fake.loads) >= 4)
    finally:
        await decode.stop(0)
        await prefill.stop(0)
        await router.stop(0)
    by_role = {w.role: w for w in fake.workers}
    p = by_role[registry_service_pb2.WORKER_ROLE_PREFILL]
    d = by_role[registry_service_pb2.WORKER_ROLE_DECODE]
    assert (p.address, p.name, d.address, d.name) == (prefill.address, "p0", decode.address, "d0")
    assert p.kv_layout == d.kv_layout == layout_to_proto(prefill.servicer.runner.kv_layout)
    assert p.model == d.model == p.kv_layout.model
    assert p.protocol_version == d.protocol_version == PROTOCOL_VERSION
    assert "nixl" in p.capabilities
    assert all(load.kv_blocks_free + load.kv_blocks_used == 32 for load in fake.loads)
