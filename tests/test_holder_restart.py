"""A prefill worker (the KV holder) killed and back at its address: what the decode side
does with it (kill review at HEAD: requests that waited out the restart were then refused
their KV and failed, 24 and 17 in two runs of four); and a closing peer client's releases
to a holder."""

from __future__ import annotations

import asyncio
import time
import types

import grpc
import pytest

from common import kv_pull
from common.server.peers import PeerClient
from common.server.rpc import RpcStatusError, start_server
from common.server.transport import RECONNECT_MAX_S
from common.transfer.types import TransferError, TransferRefusedError
from epd.v1 import prefill_service_pb2, prefill_service_pb2_grpc
from tests.cluster import free_port


class Holder(prefill_service_pb2_grpc.PrefillServiceServicer):
    async def ReleaseKv(self, request, context):
        return prefill_service_pb2.ReleaseKvResponse(released=True)


async def test_a_confirmation_waits_out_the_channels_reconnect_back_off() -> None:
    # The decode worker's channel to the holder failed while it was down, and was in its
    # reconnect back-off when the holder came back: the confirming ReleaseKv failed at
    # once, so the pulled KV was refused and prefilled again, for every request of the
    # next second.
    port = free_port()
    address = f"127.0.0.1:{port}"
    peers = PeerClient(release_timeout_s=5.0)
    try:
        assert await peers.confirm_release_kv(address, "lease-0") is None  # down: the back-off
        back = asyncio.get_running_loop().create_future()

        async def restart() -> None:
            await asyncio.sleep(0.3)
            adder = prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server
            back.set_result(await start_server([lambda s: adder(Holder(), s)], port=port))

        restarting = asyncio.create_task(restart())
        await asyncio.sleep(0.35)  # back at its address, the channel still backing off
        assert await peers.confirm_release_kv(address, "lease-1")
        await restarting
        await (await back).stop(0)
        started = time.monotonic()  # gone for good: refused within the back-off's wait
        assert await peers.confirm_release_kv(address, "lease-2") is None  # not "gone"
        assert time.monotonic() - started < 2 * RECONNECT_MAX_S + 0.5
    finally:
        await peers.close()


class FakeAgent:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.peers: dict[str, object] = {}

    def add_peer(self, metadata: bytes, force: bool = False) -> str:
        raise self.error


@pytest.mark.parametrize(
    ("error", "code"),
    [
        # The holder's agent cannot be reached (its process died): prefill again.
        (TransferError("cannot load peer metadata: NIXL_ERR_BACKEND"), grpc.StatusCode.ABORTED),
        # Metadata NIXL refuses, or malformed: the handle's fault.
        (TransferRefusedError("nixlInvalidParamError"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("truncated"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_metadata_a_dead_holder_cannot_serve_means_prefill_again(
    error: Exception, code: grpc.StatusCode
) -> None:
    # It was INVALID_ARGUMENT, blaming the handle: the router did not prefill again.
    handle = types.SimpleNamespace(agent_name="prefill-x", agent_metadata=b"md", blocks=[])
    plan = types.SimpleNamespace(pull=[0], blocks=[0])
    with pytest.raises(RpcStatusError) as caught:
        await kv_pull.pull(
            FakeAgent(error),  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            handle,  # type: ignore[arg-type]
            plan,  # type: ignore[arg-type]
            timeout_s=1.0,
            on_orphan=lambda: None,
            on_quarantine=lambda e: None,
        )
    assert caught.value.code == code and "kv.agent_metadata" in caught.value.details


async def test_close_waits_for_releases_started_while_it_waits() -> None:
    # A request's cleanup running late started a release while `close` waited for the
    # others: it went out on a channel `close` then closed, the lease pinned on the holder
    # until its TTL (races review L2, s45).
    released: list[str] = []

    class Slow(prefill_service_pb2_grpc.PrefillServiceServicer):
        async def ReleaseKv(self, request, context):
            await asyncio.sleep(0.3)
            released.append(request.lease_id)
            return prefill_service_pb2.ReleaseKvResponse(released=True)

    adder = prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server
    server = await start_server([lambda s: adder(Slow(), s)], port=0)
    peers = PeerClient(release_timeout_s=5.0)
    try:
        peers.release_kv(server.address, "first")
        closing = asyncio.create_task(peers.close())
        await asyncio.sleep(0.1)  # `close` waits for the first
        peers.release_kv(server.address, "late")
        await closing
        assert sorted(released) == ["first", "late"]
    finally:
        await server.stop(0)
