"""Authentication and tenants against a real deployment in this process: router, encoder,
prefill and decode on 127.0.0.1, each started by its own `serve` with the session's cluster
token and API keys (`tests.cluster`). Every attack of issue 10 is refused with its status
and leaves the state as it was; tenants never share a cached block or encoder entry.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from common.models.tiny import make_tiny_checkpoint
from common.roles import Role
from common.sampling import SamplingParams
from common.server.credentials import NO_CREDENTIALS, ChannelCredentials
from common.server.role import RoleServer
from common.server.rpc import channel
from common.settings.schema import SettingsError
from common.settings.security import SecuritySettings
from decode_worker.server import serve as serve_decode
from decode_worker.settings import DecodeSettings
from encoder_worker.server import serve as serve_encoder
from encoder_worker.settings import EncoderSettings
from epd.client import Client, GenerateError
from epd.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    decode_service_pb2,
    decode_service_pb2_grpc,
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    registry_service_pb2,
    registry_service_pb2_grpc,
)
from prefill_worker.server import serve as serve_prefill
from prefill_worker.settings import PrefillSettings
from router.server import RunningRouter
from router.server import serve as serve_router
from router.settings import RouterSettings
from tests.cluster import (
    ADMIN_KEY,
    CLIENT_KEY,
    OTHER_KEY,
    admin_credentials,
    cluster_credentials,
    cluster_security,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BLOCK = 8
GREEDY = SamplingParams(max_tokens=2, ignore_eos=True)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@dataclasses.dataclass
class Deployment:
    router: RunningRouter
    encoder: RoleServer[Any]
    prefill: RoleServer[Any]
    decode: RoleServer[Any]
    scaled: list[tuple[Role, int]]  # calls the router's scaler got


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dep(ckpt: Path) -> AsyncIterator[Deployment]:
    scaled: list[tuple[Role, int]] = []

    async def scaler(role: Role, replicas: int) -> int:
        scaled.append((role, replicas))
        return replicas

    security = cluster_security()
    router = await serve_router(
        RouterSettings(
            model=str(ckpt),
            port=0,
            http_port=-1,
            heartbeat_interval_s=0.1,
            security=security,
        ),
        scaler=scaler,
    )
    kw: dict[str, Any] = {
        "model": str(ckpt),
        "router_address": router.address,
        "security": security,
    }
    kv: dict[str, Any] = {"block_size": BLOCK, "num_blocks": 128}
    encoder = await serve_encoder(EncoderSettings(name="e0", **kw))
    prefill = await serve_prefill(PrefillSettings(name="p0", **kw, **kv))
    decode = await serve_decode(DecodeSettings(name="d0", **kw, **kv))
    workers: list[RoleServer[Any]] = [encoder, prefill, decode]
    for worker in workers:
        assert worker.registrar is not None
        await worker.registrar.wait_registered(30)
    yield Deployment(router, encoder, prefill, decode, scaled)
    for server in [*reversed(workers), router]:
        await server.stop(0)


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def chat(seed: int) -> list[dict[str, Any]]:
    text = f"Tenant test {seed}: describe this picture in great detail, every colour and shape."
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": png(seed)}, {"type": "text", "text": text}],
        }
    ]


async def call_code(coro: Any) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def rogue(address: str) -> registry_service_pb2.RegisterRequest:
    info = registry_service_pb2.WorkerInfo(
        role=registry_service_pb2.WORKER_ROLE_DECODE, address=address, name="rogue"
    )
    return registry_service_pb2.RegisterRequest(worker=info)


def addresses(dep: Deployment) -> set[str]:
    return {w.address for w in dep.router.registry.workers()}


# ------------------------------------------------------------------------ the attacks


@pytest.mark.parametrize(
    ("credentials", "code"),
    [(NO_CREDENTIALS, UNAUTHENTICATED), (ChannelCredentials(CLIENT_KEY), DENIED)],
    ids=["no-token", "client-key"],
)
async def test_rogue_register_is_refused(
    dep: Deployment, credentials: ChannelCredentials, code: grpc.StatusCode
) -> None:
    before = addresses(dep)
    async with channel(dep.router.address, credentials=credentials) as ch:
        stub = registry_service_pb2_grpc.RegistryServiceStub(ch)
        assert await call_code(stub.Register(rogue("127.0.0.1:9"))) == code
        beat = registry_service_pb2.HeartbeatRequest(worker_id="x")
        assert await call_code(stub.Heartbeat(beat)) == code
    assert addresses(dep) == before


async def test_register_needs_a_well_formed_address(dep: Deployment) -> None:
    before = addresses(dep)
    async with channel(dep.router.address, credentials=cluster_credentials()) as ch:
        stub = registry_service_pb2_grpc.RegistryServiceStub(ch)
        for bad in ("not an address", "host:0", "host:99999", ":80", "a/b:1", "host:x"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Register(rogue(bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "worker.address" in str(err.value.details())
    assert addresses(dep) == before


@pytest.mark.parametrize(
    ("credentials", "code"),
    [
        (NO_CREDENTIALS, UNAUTHENTICATED),
        (ChannelCredentials("epd-a-key-nobody-was-given"), UNAUTHENTICATED),
        (ChannelCredentials(CLIENT_KEY), DENIED),
    ],
    ids=["no-key", "wrong-key", "client-key"],
)
async def test_admin_calls_need_an_admin_key(
    dep: Deployment, credentials: ChannelCredentials, code: grpc.StatusCode
) -> None:
    decode = dep.decode.address
    async with channel(dep.router.address, credentials=credentials) as ch:
        admin = admin_service_pb2_grpc.AdminServiceStub(ch)
        drain = admin_service_pb2.DrainRequest(address=decode)
        assert await call_code(admin.Drain(drain)) == code
        scale = admin_service_pb2.ScaleRequest(
            role=registry_service_pb2.WORKER_ROLE_PREFILL, replicas=64
        )
        assert await call_code(admin.Scale(scale)) == code
        assert await call_code(admin.Status(admin_service_pb2.StatusRequest())) == code
    assert dep.scaled == []
    assert not any(w.draining for w in dep.router.registry.workers())


async def test_an_admin_key_sees_status_and_may_scale(dep: Deployment) -> None:
    async with channel(dep.router.address, credentials=admin_credentials()) as ch:
        admin = admin_service_pb2_grpc.AdminServiceStub(ch)
        status = await admin.Status(admin_service_pb2.StatusRequest())
        assert {w.info.address for w in status.workers} == addresses(dep)
        scale = admin_service_pb2.ScaleRequest(
            role=registry_service_pb2.WORKER_ROLE_PREFILL, replicas=1
        )
        assert (await admin.Scale(scale)).replicas == 1
    assert dep.scaled == [(Role.PREFILL, 1)]
    dep.scaled.clear()


async def test_a_client_key_cannot_call_the_workers(dep: Deployment) -> None:
    calls = {
        dep.encoder.address: lambda ch: encoder_service_pb2_grpc.EncoderServiceStub(ch).Encode(
            encoder_service_pb2.EncodeRequest(request_id="x")
        ),
        dep.prefill.address: lambda ch: prefill_service_pb2_grpc.PrefillServiceStub(ch).Prefill(
            prefill_service_pb2.PrefillRequest(request_id="x")
        ),
        dep.decode.address: lambda ch: _drain_stream(
            decode_service_pb2_grpc.DecodeServiceStub(ch).Decode(
                decode_service_pb2.DecodeRequest(request_id="x")
            )
        ),
    }
    for key, code in ((CLIENT_KEY, DENIED), (ADMIN_KEY, DENIED), (None, UNAUTHENTICATED)):
        for address, call in calls.items():
            async with channel(address, credentials=ChannelCredentials(key)) as ch:
                assert await call_code(call(ch)) == code, (address, key)
        async with channel(dep.prefill.address, credentials=ChannelCredentials(key)) as ch:
            release = prefill_service_pb2.ReleaseKvRequest(lease_id="x")
            stub = prefill_service_pb2_grpc.PrefillServiceStub(ch)
            assert await call_code(stub.ReleaseKv(release)) == code
    assert dep.prefill.servicer.active == 0 and dep.decode.servicer.active == 0


async def _drain_stream(call: Any) -> None:
    async for _ in call:
        pass


@pytest.mark.parametrize("key", [None, "epd-a-key-nobody-was-given"], ids=["no-key", "wrong-key"])
async def test_generate_needs_a_known_key(dep: Deployment, key: str | None) -> None:
    async with Client(dep.router.address, api_key=key or "") as client:
        with pytest.raises(GenerateError) as err:
            await client.generate_text(chat(1), GREEDY)
    assert err.value.code == UNAUTHENTICATED


async def test_health_stays_open(dep: Deployment) -> None:
    for server in (dep.router, dep.encoder, dep.prefill, dep.decode):
        async with channel(server.address) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------------------ tenants


async def test_tenants_never_share_cached_blocks_or_encoder_entries(dep: Deployment) -> None:
    messages = chat(7)
    encoder = dep.encoder.servicer.engine.cache
    async with Client(dep.router.address, api_key=CLIENT_KEY) as client:
        first = await client.generate_text(messages, GREEDY, timeout_s=60)
        hits = encoder.hits
        # Tenant B replays A's prompt, even with A's salt: nothing of A's is reused.
        other = await client.generate_text(
            messages, GREEDY, timeout_s=60, api_key=OTHER_KEY, cache_salt=None
        )
        assert encoder.hits == hits  # B's image was encoded again, under B's salt
        again = await client.generate_text(messages, GREEDY, timeout_s=60)
    assert first.cached_tokens == 0 and first.prompt_tokens > 2 * BLOCK
    assert other.cached_tokens == 0
    assert other.token_ids == first.token_ids  # same answer, own cache
    assert again.cached_tokens == (first.prompt_tokens - 1) // BLOCK * BLOCK


async def test_a_client_salt_only_splits_its_own_tenants_cache(dep: Deployment) -> None:
    messages = chat(8)
    async with Client(dep.router.address, api_key=OTHER_KEY) as client:
        await client.generate_text(messages, GREEDY, timeout_s=60, cache_salt="user-1")
        split = await client.generate_text(messages, GREEDY, timeout_s=60, cache_salt="user-2")
        same = await client.generate_text(messages, GREEDY, timeout_s=60, cache_salt="user-1")
    async with Client(dep.router.address, api_key=CLIENT_KEY) as client:
        spoof = await client.generate_text(messages, GREEDY, timeout_s=60, cache_salt="user-1")
    assert split.cached_tokens == 0 and spoof.cached_tokens == 0
    assert same.cached_tokens > 0


async def test_servers_without_their_secrets_refuse_to_start(ckpt: Path, tmp_path: Path) -> None:
    token_only = SecuritySettings(cluster_token_file=cluster_security().cluster_token_file)
    with pytest.raises(SettingsError, match=r"security\.api_keys_file"):
        await serve_router(
            RouterSettings(model=str(ckpt), port=0, http_port=-1, security=token_only)
        )
    with pytest.raises(SettingsError, match=r"security\.cluster_token_file"):
        await serve_encoder(EncoderSettings(model=str(ckpt)))
    bad = tmp_path / "keys.toml"
    bad.write_text('[[keys]]\nkey = "short"\ntenant = "t"\n')
    broken = dataclasses.replace(token_only, api_keys_file=str(bad))
    with pytest.raises(SettingsError, match=r"security\.api_keys_file: keys\[0\]\.key"):
        await serve_router(RouterSettings(model=str(ckpt), port=0, http_port=-1, security=broken))


async def test_insecure_turns_auth_off_and_says_so(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = RouterSettings(
        model=str(ckpt), port=0, http_port=-1, security=SecuritySettings(insecure=True)
    )
    with caplog.at_level(logging.WARNING):
        router = await serve_router(settings)
    try:
        async with channel(router.address) as ch:
            status = await admin_service_pb2_grpc.AdminServiceStub(ch).Status(
                admin_service_pb2.StatusRequest()
            )
    finally:
        await router.stop(0)
    assert status.model
    assert "authentication is OFF" in caplog.text
