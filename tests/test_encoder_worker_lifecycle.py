"""Tests for the encoder worker's life around the encoding: it registers with the router
and reports its cache, drains (finishing an encode in flight, refusing new ones), checks its
settings, and `python -m encoder_worker` serves health and Encode and exits on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import Processor
from common.roles import EMBEDDING_DIGESTS, PATCH_CODES
from common.server.rpc import channel, start_server, wait_healthy
from common.settings.schema import SettingsError
from encoder_worker.settings import EncoderSettings
from epd.v1 import encoder_service_pb2_grpc, registry_service_pb2, registry_service_pb2_grpc
from tests.cluster import cluster_credentials, cluster_security
from tests.cluster import free_port as cluster_free_port
from tests.encoder_worker_helpers import (
    Factory,
    _image,
    _item,
    _request,
    _rows,
    make_server,
    tower,
)
from tests.test_registrar import FakeRegistry

__all__ = ["make_server", "tower"]  # fixtures shared with the other encoder worker tests

ROOT = Path(__file__).resolve().parent.parent


async def test_registers_with_router_and_reports_cache(
    make_server: Factory, processor: Processor
) -> None:
    fake = FakeRegistry()
    router = await start_server(
        [lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(fake, s)]
    )
    try:
        server, stub = await make_server(router_address=router.address, name="enc-a")
        assert server.registrar is not None
        await server.registrar.wait_registered(10)
        (info,) = fake.registered
        assert info.role == registry_service_pb2.WORKER_ROLE_ENCODER
        assert info.address == server.address and info.name == "enc-a"
        assert info.protocol_version == "epd.v1" and info.model.startswith("qwen3-vl/")
        assert PATCH_CODES in info.capabilities  # a router sends it uint8 codes
        assert EMBEDDING_DIGESTS in info.capabilities  # a router refuses it otherwise
        request = _request(_item(_image(processor, 50)))
        await stub.Encode(request, timeout=30)
        await stub.Encode(request, timeout=30)
        deadline = time.monotonic() + 10
        while not any(load.cache_hits == 1 for load in fake.loads):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert fake.loads[-1].cache_lookups == 2
    finally:
        await router.stop(0)


async def test_drain_finishes_encode_in_flight_and_refuses_new(
    make_server: Factory, processor: Processor
) -> None:
    server, stub = await make_server(batch_window_ms=300)
    lifecycle = server.lifecycle
    assert lifecycle is not None
    in_flight = asyncio.ensure_future(
        stub.Encode(_request(_item(_image(processor, 70))), timeout=30)
    )
    while lifecycle.active == 0:
        await asyncio.sleep(0.005)
    drain = asyncio.create_task(lifecycle.drain(timeout_s=30))
    while not lifecycle.draining:
        await asyncio.sleep(0.005)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(_request(_item(_image(processor, 71))), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (await in_flight).items[0].rows.shape
    assert await drain is True and server.stopped


def test_settings_are_checked() -> None:
    with pytest.raises(SettingsError, match="dtype"):
        EncoderSettings(dtype="float64").check()
    secure = cluster_security()
    with pytest.raises(SettingsError, match="lease_ttl_s"):
        EncoderSettings(lease_ttl_s=0, security=secure).check()
    with pytest.raises(SettingsError, match="lease_ttl_s: must be at least"):
        EncoderSettings(lease_ttl_s=0.01, security=secure).check()
    with pytest.raises(SettingsError, match="output_pool_mb"):
        EncoderSettings(output_pool_mb=-1, security=secure).check()
    with pytest.raises(SettingsError, match=r"security\.cluster_token_file"):
        EncoderSettings().check()  # the encoder, too, refuses to run without the token


@pytest.fixture
def free_port() -> Iterator[int]:
    yield cluster_free_port()


@pytest.mark.slow
async def test_subprocess_serves_health_and_encode(
    ckpt: Path, processor: Processor, tower: VisionTower, free_port: int
) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "encoder_worker",
            "--port",
            str(free_port),
            "--model",
            str(ckpt),
            "--nixl",
            "false",
            "--log-level",
            "WARNING",
            "--security-cluster-token-file",
            str(cluster_security().cluster_token_file),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        address = f"127.0.0.1:{free_port}"
        await wait_healthy(address, timeout_s=90, service="epd.v1.EncoderService")
        prompt = _image(processor, 60)
        async with channel(address, credentials=cluster_credentials()) as ch:
            reply = await encoder_service_pb2_grpc.EncoderServiceStub(ch).Encode(
                _request(_item(prompt)), timeout=60
            )
        rows, _ = tower.encode(*prompt.vision_inputs())
        assert torch.equal(_rows(reply.items[0])[0], rows)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert proc.stderr is not None
        proc.stderr.close()
