"""gRPC server reflection on every epd server (`common.server.rpc.start_server`): open to
anyone, like health, on a router that authenticates everything else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.models.tiny import make_tiny_checkpoint
from common.server.auth import Need, need_for
from common.server.rpc import channel, start_server
from epd.v1 import router_service_pb2, router_service_pb2_grpc
from router.server import RunningRouter
from router.server import serve as serve_router
from router.settings import RouterSettings
from tests.cluster import cluster_security

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(ckpt: Path) -> AsyncIterator[RunningRouter]:
    server = await serve_router(
        RouterSettings(model=str(ckpt), port=0, http_port=-1, security=cluster_security())
    )
    yield server
    await server.stop(0)


async def ask(address: str, **request: Any) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request, without credentials."""
    async with channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]))
        replies = [reply async for reply in call]
    assert len(replies) == 1
    return replies[0]


async def test_reflection_lists_the_routers_services_without_credentials(
    router: RunningRouter,
) -> None:
    reply = await ask(router.address, list_services="")
    names = {s.name for s in reply.list_services_response.service}
    assert names == {
        "epd.v1.RouterService",
        "epd.v1.RegistryService",
        "epd.v1.AdminService",
        "grpc.health.v1.Health",
        REFLECTION,
    }


async def test_reflection_gives_the_router_services_file_descriptor(router: RunningRouter) -> None:
    reply = await ask(router.address, file_containing_symbol="epd.v1.RouterService")
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in reply.file_descriptor_response.file_descriptor_proto
    ]
    mine = next(f for f in files if f.name == router_service_pb2.DESCRIPTOR.name)
    assert mine.package == "epd.v1"
    service = next(s for s in mine.service if s.name == "RouterService")
    generate = next(m for m in service.method if m.name == "Generate")
    assert generate.server_streaming and generate.output_type == ".epd.v1.GenerateResponse"


async def test_reflection_opens_nothing_else(router: RunningRouter) -> None:
    async with channel(router.address) as ch:
        stub = router_service_pb2_grpc.RouterServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(router_service_pb2.GenerateRequest()):
                pass
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_every_server_serves_reflection() -> None:
    server = await start_server([], service_names=["epd.v1.DecodeService"])
    try:
        reply = await ask(server.address, list_services="")
    finally:
        await server.stop(0)
    names = {s.name for s in reply.list_services_response.service}
    assert names == {"epd.v1.DecodeService", "grpc.health.v1.Health", REFLECTION}


async def test_reflection_is_open_like_health() -> None:
    assert need_for(f"/{REFLECTION}/ServerReflectionInfo") is Need.OPEN
    assert need_for("/grpc.health.v1.Health/Check") is Need.OPEN
    assert need_for("/epd.v1.DecodeService/Decode") is Need.CLUSTER
