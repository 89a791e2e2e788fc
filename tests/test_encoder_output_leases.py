"""Tests for the encoder worker's outputs over NIXL: an output past the inline limit goes by
handle and its lease is released once (or expires); outputs share one metadata snapshot and
reuse the ranges released leases give back in the output arena; an output that does not fit
the arena gets its own registered buffer, deregistered on release."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import ProcessedPrompt, Processor
from epd.v1 import encoder_service_pb2
from tests.encoder_worker_helpers import Factory, _image, _item, _request, make_server, tower

__all__ = ["make_server", "tower"]  # fixtures shared with the other encoder worker tests


def _output_bytes(prompt: ProcessedPrompt, tower: VisionTower) -> int:
    cfg = tower.config
    tensors = 1 + len(cfg.deepstack_visual_indexes)  # rows + deepstack layers, float32
    return prompt.params.items[0].length * cfg.out_hidden_size * 4 * tensors


async def test_large_output_goes_over_nixl_and_is_released(
    make_server: Factory, processor: Processor, tower: VisionTower
) -> None:
    transfer = pytest.importorskip("common.transfer.agent")
    from common.wire.transfer import read_tensor

    try:
        reader = await asyncio.to_thread(transfer.TransferAgent, "reader")
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"NIXL unavailable: {exc}")
    try:
        small, large, other = (
            _image(processor, 40),
            _image(processor, 41, 128, 128),
            _image(processor, 42, 128, 128),
        )
        limit = 4096
        assert _output_bytes(small, tower) <= limit < _output_bytes(large, tower)
        server, stub = await make_server(nixl=True, inline_limit_bytes=limit)
        reply = await stub.Encode(_request(_item(small), _item(large)), timeout=60)
        assert reply.items[0].rows.WhichOneof("data") == "inline_data"  # below the limit
        item = reply.items[1]
        refs = [item.rows, *item.deepstack]
        assert all(ref.WhichOneof("data") == "handle" for ref in refs)
        lease_ids = {ref.handle.lease_id for ref in refs}
        assert len(lease_ids) == 1
        pulled = [
            await asyncio.to_thread(
                read_tensor, ref.handle, torch.float32, tuple(ref.shape), reader
            )
            for ref in refs
        ]
        rows, deep = tower.encode(*large.vision_inputs())
        torch.testing.assert_close(pulled[0], rows, rtol=1e-5, atol=1e-5)
        for got, want in zip(pulled[1:], deep, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

        leases = server.servicer.leases if server.servicer else None
        assert leases is not None and len(leases) == 1
        release = encoder_service_pb2.ReleaseEmbeddingsRequest(lease_ids=sorted(lease_ids))
        assert (await stub.ReleaseEmbeddings(release, timeout=10)).released == 1
        assert (await stub.ReleaseEmbeddings(release, timeout=10)).released == 0
        assert len(leases) == 0
        assert server.servicer is not None
        counters = server.servicer.counters
        assert counters.leases == 0 and counters.leases_released == 1

        # A reader that never releases: the lease expires (its log line names the request:
        # it said "(request )", chaos review s38).
        await stub.Encode(_request(_item(other), request_id="r-other"), timeout=60)
        assert len(leases) == 1
        assert [lease.request_id for lease in leases.table._leases.values()] == ["r-other"]
        leases.table.clock = lambda: time.monotonic() + 3600
        assert leases.expire() == 1 and len(leases) == 0
    finally:
        await asyncio.to_thread(reader.close)


async def _reader() -> Any:
    transfer = pytest.importorskip("common.transfer.agent")
    try:
        return await asyncio.to_thread(transfer.TransferAgent, "reader")
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"NIXL unavailable: {exc}")


async def test_outputs_share_one_snapshot_and_reuse_released_ranges(
    make_server: Factory, processor: Processor, tower: VisionTower
) -> None:
    from common.wire.transfer import read_tensor

    reader = await _reader()
    try:
        server, stub = await make_server(nixl=True, inline_limit_bytes=4096, output_pool_mb=1)
        leases = server.servicer.leases if server.servicer else None
        assert leases is not None
        replies = [
            await stub.Encode(_request(_item(_image(processor, seed, 128, 128))), timeout=60)
            for seed in (80, 81)
        ]
        refs = [[item.rows, *item.deepstack] for r in replies for item in r.items]
        handles = [ref.handle for group in refs for ref in group]
        agent = await leases.agent()
        assert agent is not None and leases.arena is not None
        # One snapshot, taken once: the encoder's metadata did not change while serving.
        assert {h.agent_metadata for h in handles} == {agent.metadata()}
        # Each tensor lies in the arena, 64-byte aligned, the two leases apart.
        base = leases.arena.buffer.data_ptr()
        assert all(h.address % 64 == 0 and h.address >= base for h in handles)
        assert len({h.address for h in handles}) == len(handles)
        for group in refs:
            for ref in group:
                got = await asyncio.to_thread(
                    read_tensor, ref.handle, torch.float32, tuple(ref.shape), reader
                )
                assert got.shape == tuple(ref.shape)
        first = refs[0][0].handle
        release = encoder_service_pb2.ReleaseEmbeddingsRequest(lease_ids=[first.lease_id])
        assert (await stub.ReleaseEmbeddings(release, timeout=10)).released == 1
        # The next output takes the range the released lease gave back (the lowest free).
        reply = await stub.Encode(_request(_item(_image(processor, 82, 128, 128))), timeout=60)
        again = reply.items[0].rows.handle
        assert again.address == first.address and again.lease_id != first.lease_id
        assert again.agent_metadata == first.agent_metadata
        prompt = _image(processor, 82, 128, 128)
        rows, _ = tower.encode(*prompt.vision_inputs())
        shape = tuple(reply.items[0].rows.shape)
        got = await asyncio.to_thread(read_tensor, again, torch.float32, shape, reader)
        torch.testing.assert_close(got, rows, rtol=1e-5, atol=1e-5)
        assert server.servicer is not None and server.servicer.counters.leases_unpooled == 0
        # Release the rest, so stopping the server need not wait for them to expire.
        rest = sorted({h.lease_id for h in handles} | {again.lease_id})
        await stub.ReleaseEmbeddings(
            encoder_service_pb2.ReleaseEmbeddingsRequest(lease_ids=rest), timeout=10
        )
    finally:
        await asyncio.to_thread(reader.close)


async def test_output_that_does_not_fit_gets_its_own_registered_buffer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from common.transfer.agent import TransferAgent
    from common.wire.transfer import read_tensor
    from encoder_worker.leases import OutputLeases

    reader = await _reader()
    leases = OutputLeases(30.0, pool_bytes=4096, agent_factory=lambda: TransferAgent("enc"))
    try:
        leases.start()
        agent = await leases.agent()
        assert agent is not None and leases.arena is not None
        outputs = [torch.full((750,), float(k)) for k in range(4)]  # 3000 bytes each
        pooled = leases.export(agent, [outputs[0]])
        with caplog.at_level("INFO", logger="encoder_worker.leases"):
            own = [leases.export(agent, [t]) for t in outputs[1:]]  # the arena is full
        assert leases.unpooled == 3 and leases.exported == 4
        warned = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and "does not fit the output arena" in warned[0].message
        # Own buffers change the metadata: each lease's handles carry a fresh snapshot.
        snapshots = {pooled[0].agent_metadata, *(h[0].agent_metadata for h in own)}
        assert len(snapshots) == 4
        for k, (handle,) in enumerate([pooled, *own]):
            got = await asyncio.to_thread(read_tensor, handle, torch.float32, (750,), reader)
            assert torch.equal(got, outputs[k])
        # Freeing: the arena range goes back; own buffers are deregistered.
        assert leases.release([h[0].lease_id for h in own]) == 3
        assert all(agent.region_of(h[0].address, 3000) is None for h in own)
        assert leases.release([pooled[0].lease_id]) == 1
        assert leases.arena.allocator.free_ranges() == [(0, 4096)]
        assert agent.region_of(pooled[0].address, 3000) is not None  # the arena stays
    finally:
        await leases.close()
        await asyncio.to_thread(reader.close)


async def test_outputs_lease_under_the_callers_key_and_a_released_key_makes_none(
    make_server: Factory, processor: Processor
) -> None:
    """The router names a request's output leases (`lease_key`) so that it can release
    those of an answer it never got; released first, they are never made."""
    import grpc

    pytest.importorskip("common.transfer.agent")
    server, stub = await make_server(nixl=True, inline_limit_bytes=4096)
    leases = server.servicer.leases if server.servicer else None
    if leases is None or await leases.agent() is None:
        pytest.skip("NIXL unavailable")
    small, large = _image(processor, 50), _image(processor, 51, 128, 128)
    request = _request(_item(small), _item(large))
    request.lease_key = "router-key"
    reply = await stub.Encode(request, timeout=60)
    assert reply.items[1].rows.handle.lease_id == "router-key-1"  # item 1, by handle
    release = encoder_service_pb2.ReleaseEmbeddingsRequest(
        lease_ids=["router-key-0", "router-key-1"]  # the router knows the ids, not the sizes
    )
    assert (await stub.ReleaseEmbeddings(release, timeout=10)).released == 1
    assert len(leases) == 0

    # Released before the answer was made (the router's call ended without it): the
    # encoder makes no lease under those ids, and answers CANCELLED.
    request.lease_key = "given-up"
    release = encoder_service_pb2.ReleaseEmbeddingsRequest(lease_ids=["given-up-0", "given-up-1"])
    assert (await stub.ReleaseEmbeddings(release, timeout=10)).released == 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Encode(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.CANCELLED
    assert "lease_key" in (refused.value.details() or "") and len(leases) == 0

    for bad in ("has space", "k" * 49):
        request.lease_key = bad
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            await stub.Encode(request, timeout=60)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lease_key" in (malformed.value.details() or "")


async def test_the_agent_is_made_before_the_encoder_serves(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Making a NIXL agent, UCX moves the program break to test its hooks: made after the
    # server started (it was), that ran beside requests and aborted an encoder in glibc
    # (chaos review, s37; `scripts/ucx_hooks_race.py` shows the race).
    from common.server.role import RoleServer
    from encoder_worker import leases

    events: list[str] = []
    made = leases.TransferAgent

    def agent(name: str) -> Any:
        events.append("agent")
        return made(name)

    start = RoleServer.start.__func__  # type: ignore[attr-defined]

    async def started(cls: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("serving")
        return await start(cls, *args, **kwargs)

    monkeypatch.setattr(leases, "TransferAgent", agent)
    monkeypatch.setattr(RoleServer, "start", classmethod(started))
    server, _ = await make_server(nixl=True)
    assert events == ["agent", "serving"]
    assert server.servicer is not None and server.servicer.leases is not None
    assert server.servicer.leases.arena is not None  # registered before serving too


async def test_an_agent_whose_snapshot_fails_is_closed_and_outputs_go_inline(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Made, then its metadata snapshot raised: the agent was never closed, and the encoder
    # failed to start (s38diff review). Now as when no agent can be made: outputs inline.
    from encoder_worker import leases

    closed: list[str] = []
    made = leases.TransferAgent

    class Unusable:
        def __init__(self, name: str) -> None:
            self.real = made(name)
            self.name = name

        def register(self, buffer: Any) -> Any:
            return self.real.register(buffer)

        def metadata(self) -> bytes:
            raise RuntimeError("no snapshot")

        def close(self) -> None:
            closed.append(self.name)
            self.real.close()

    monkeypatch.setattr(leases, "TransferAgent", Unusable)
    server, _ = await make_server(nixl=True)
    assert server.servicer.leases is not None
    assert await server.servicer.leases.agent() is None and server.servicer.leases.arena is None
    assert len(closed) == 1
