"""Tests for the encoder worker: outputs vs the vision tower, cache, partitions, batching,
NIXL outputs and leases, validation, registration, and the `python -m encoder_worker` process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from common.models.qwen3_vl.vision import VisionTower
from common.processing.processor import ProcessedPrompt, Processor
from common.roles import PATCH_CODES
from common.server.role import RoleServer
from common.server.rpc import channel, start_server, wait_healthy
from common.settings.schema import SettingsError
from common.wire.convert import tensor_from_ref, tensor_to_ref
from encoder_worker.cache import EncodedRows, EncoderCache
from encoder_worker.server import EncoderServicer, load_tower, serve
from encoder_worker.settings import EncoderSettings
from epd.v1 import (
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    multimodal_pb2,
    registry_service_pb2,
    registry_service_pb2_grpc,
)
from tests.cluster import cluster_credentials, cluster_security
from tests.test_rpc import FakeRegistry

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tower(ckpt: Path) -> VisionTower:
    return load_tower(ckpt, EncoderSettings())[1]


def _user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _image(processor: Processor, seed: int, h: int = 64, w: int = 64) -> ProcessedPrompt:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return processor.process(_user({"type": "image", "image": data}))


def _video(processor: Processor, seed: int, frames: int = 6) -> ProcessedPrompt:
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(frames)]
    return processor.process(_user({"type": "video", "video": data, "fps": 2.0}))


def _item(
    prompt: ProcessedPrompt, partitions: tuple[int, ...] = (), subset_pixels: bool = False
) -> encoder_service_pb2.EncodeItem:
    meta = prompt.params.items[0]
    pixels = prompt.pixel_values[0]
    if subset_pixels:
        pixels = torch.cat(
            [
                pixels[meta.partitions[p].input_start : meta.partitions[p].input_end]
                for p in partitions
            ]
        )
    modality = {
        "image": multimodal_pb2.MODALITY_IMAGE,
        "video": multimodal_pb2.MODALITY_VIDEO,
    }[str(meta.modality)]
    return encoder_service_pb2.EncodeItem(
        content_hash=meta.content_hash,
        modality=modality,
        pixel_values=tensor_to_ref(pixels),
        grid_thw=list(prompt.grid_thw[0]),
        partitions=[
            multimodal_pb2.ItemPartition(
                input_start=p.input_start,
                input_end=p.input_end,
                output_rows=p.output_rows,
                content_hash=p.content_hash,
            )
            for p in meta.partitions
        ],
        partition_indices=list(partitions),
    )


def _request(*items: encoder_service_pb2.EncodeItem) -> encoder_service_pb2.EncodeRequest:
    return encoder_service_pb2.EncodeRequest(request_id="t", items=list(items))


def _rows(item: encoder_service_pb2.EncodedItem) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return tensor_from_ref(item.rows), [tensor_from_ref(d) for d in item.deepstack]


Factory = Callable[..., Awaitable[tuple[RoleServer[EncoderServicer], Any]]]


@pytest.fixture
async def make_server(ckpt: Path) -> AsyncIterator[Factory]:
    """Start encoder workers (NIXL off unless asked); stops them and their channels."""
    started: list[tuple[RoleServer[EncoderServicer], Any]] = []

    async def make(**overrides: Any) -> tuple[RoleServer[EncoderServicer], Any]:
        fields: dict[str, Any] = {
            "model": str(ckpt),
            "nixl": False,
            "security": cluster_security(),
            **overrides,
        }
        server = await serve(EncoderSettings(**fields))
        ch = channel(server.address, credentials=cluster_credentials())
        started.append((server, ch))
        return server, encoder_service_pb2_grpc.EncoderServiceStub(ch)

    yield make
    for server, ch in started:
        await ch.close()
        await server.stop(0)


def _engine(server: RoleServer[EncoderServicer]) -> Any:
    assert server.servicer is not None
    return server.servicer.engine


def _count_forwards(server: RoleServer[EncoderServicer]) -> list[int]:
    """Wrap the tower's encode to count calls (independent of the engine's counter)."""
    engine = _engine(server)
    calls = [0]
    original = engine.tower.encode

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    engine.tower.encode = counted
    return calls


# ---------------------------------------------------------------------------- the tests


async def test_output_equals_vision_tower(
    make_server: Factory, processor: Processor, tower: VisionTower
) -> None:
    _, stub = await make_server()
    images = [_image(processor, 1), _image(processor, 2, 48, 80)]
    video = _video(processor, 3)
    reply = await stub.Encode(_request(*(_item(p) for p in images), _item(video)), timeout=30)
    assert len(reply.items) == 3

    # The worker batches the two whole images into one forward: the same call here.
    pixels = torch.cat([p.vision_inputs()[0] for p in images])
    grids = torch.tensor([p.grid_thw[0] for p in images])
    rows, deep = tower.encode(pixels, grids)
    sizes = tower.rows_per_item(grids)
    for k, prompt in enumerate(images):
        got_rows, got_deep = _rows(reply.items[k])
        assert reply.items[k].content_hash == prompt.params.items[0].content_hash
        assert not reply.items[k].cache_hit
        assert torch.equal(got_rows, rows.split(sizes)[k])
        assert all(torch.equal(g, d.split(sizes)[k]) for g, d in zip(got_deep, deep, strict=True))
        solo, _ = tower.encode(*prompt.vision_inputs())
        torch.testing.assert_close(got_rows, solo, rtol=1e-5, atol=1e-5)

    # Partitioned video: frame-by-frame encoding, bit-exact; equal to the whole pass too.
    v_pixels, v_grid = video.vision_inputs()
    exact_rows, exact_deep = tower.encode(v_pixels, v_grid, per_frame=True)
    got_rows, got_deep = _rows(reply.items[2])
    assert torch.equal(got_rows, exact_rows)
    assert all(torch.equal(g, d) for g, d in zip(got_deep, exact_deep, strict=True))
    whole_rows, _ = tower.encode(v_pixels, v_grid)
    torch.testing.assert_close(got_rows, whole_rows, rtol=1e-5, atol=1e-5)
    assert got_rows.shape == (video.params.items[0].length, tower.config.out_hidden_size)


async def test_second_request_is_a_cache_hit(make_server: Factory, processor: Processor) -> None:
    server, stub = await make_server()
    calls = _count_forwards(server)
    request = _request(_item(_image(processor, 4)))
    first = await stub.Encode(request, timeout=30)
    assert calls[0] == 1
    second = await stub.Encode(request, timeout=30)
    assert calls[0] == 1  # no vision forward
    assert second.items[0].cache_hit and not first.items[0].cache_hit
    assert torch.equal(_rows(first.items[0])[0], _rows(second.items[0])[0])
    load = server.servicer.load() if server.servicer else None
    assert load is not None and (load.cache_hits, load.cache_lookups) == (1, 2)
    assert _engine(server).forward_calls == 1
    assert server.servicer is not None
    counters = server.servicer.counters
    assert counters.cache_entries == 1 and counters.rows_encoded == 4


async def test_partition_subset_returns_those_rows(
    make_server: Factory, processor: Processor
) -> None:
    server, stub = await make_server()
    video = _video(processor, 5)
    parts = video.params.items[0].partitions
    assert len(parts) == 3
    whole = await stub.Encode(_request(_item(video)), timeout=30)
    whole_rows, whole_deep = _rows(whole.items[0])
    bounds = np.cumsum([0] + [p.output_rows for p in parts])

    def expected(ps: tuple[int, ...], t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[bounds[p] : bounds[p + 1]] for p in ps])

    calls = _count_forwards(server)
    for subset_pixels in (False, True):
        reply = await stub.Encode(_request(_item(video, (0, 2), subset_pixels)), timeout=30)
        got_rows, got_deep = _rows(reply.items[0])
        assert list(reply.items[0].partition_indices) == [0, 2]
        assert reply.items[0].cache_hit
        assert torch.equal(got_rows, expected((0, 2), whole_rows))
        assert torch.equal(got_deep[1], expected((0, 2), whole_deep[1]))
    assert calls[0] == 0

    # A fresh worker encodes only the partitions asked for, and later only the rest.
    fresh, fresh_stub = await make_server()
    reply = await fresh_stub.Encode(_request(_item(video, (1,), subset_pixels=True)), timeout=30)
    assert torch.equal(_rows(reply.items[0])[0], expected((1,), whole_rows))
    assert _engine(fresh).rows_encoded == parts[1].output_rows
    reply = await fresh_stub.Encode(_request(_item(video)), timeout=30)
    assert torch.equal(_rows(reply.items[0])[0], whole_rows)
    assert not reply.items[0].cache_hit
    assert _engine(fresh).rows_encoded == sum(p.output_rows for p in parts)


def _entry(rows: int) -> EncodedRows:
    return EncodedRows.of(torch.zeros(rows, 4), (torch.zeros(rows, 4),))  # 32 bytes per row


def test_cache_lru_order_and_budget() -> None:
    cache = EncoderCache(budget_bytes=3 * 32 * 2)
    for key in (b"a", b"b", b"c"):
        assert cache.put(key, _entry(2))
    assert cache.bytes_used == 192
    assert cache.get(b"a") is not None  # a becomes most recent
    cache.put(b"d", _entry(2))
    assert cache.keys() == [b"c", b"a", b"d"] and cache.evictions == 1
    cache.put(b"e", _entry(4))  # needs two slots: evicts c and a
    assert cache.keys() == [b"d", b"e"] and cache.bytes_used == 192
    assert not cache.put(b"huge", _entry(7))  # larger than the budget: not stored
    assert b"huge" not in cache and cache.keys() == [b"d", b"e"]
    assert (cache.hits, cache.lookups) == (1, 1)


async def test_lru_eviction_in_the_worker(
    make_server: Factory, processor: Processor, tower: VisionTower
) -> None:
    prompts = [_image(processor, 10 + k) for k in range(3)]
    cfg = tower.config
    tensors = 1 + len(cfg.deepstack_visual_indexes)  # rows + deepstack layers, float32
    one_item = prompts[0].params.items[0].length * cfg.out_hidden_size * 4 * tensors
    server, stub = await make_server(cache_bytes=2 * one_item)
    for prompt in prompts:
        await stub.Encode(_request(_item(prompt)), timeout=30)
    cache = _engine(server).cache
    hashes = [p.params.items[0].content_hash for p in prompts]
    assert cache.keys() == hashes[1:] and cache.evictions == 1
    calls = _count_forwards(server)
    again = await stub.Encode(_request(_item(prompts[0])), timeout=30)
    assert not again.items[0].cache_hit and calls[0] == 1
    assert cache.keys() == [hashes[2], hashes[0]]


async def test_concurrent_requests_share_one_forward(
    make_server: Factory, processor: Processor
) -> None:
    server, stub = await make_server(batch_window_ms=200)
    calls = _count_forwards(server)
    prompts = [_image(processor, 20 + k) for k in range(3)]
    requests = [_request(_item(p)) for p in prompts] + [_request(_item(prompts[0]))]
    replies = await asyncio.gather(*(stub.Encode(r, timeout=30) for r in requests))
    assert calls[0] == 1
    engine = _engine(server)
    assert engine.batches == 1 and engine.units_encoded == 3  # the duplicate joined
    assert torch.equal(_rows(replies[0].items[0])[0], _rows(replies[3].items[0])[0])


BAD_HASH = b"\x01" * 31


def _malformed(case: str, good: encoder_service_pb2.EncodeItem) -> encoder_service_pb2.EncodeItem:
    item = encoder_service_pb2.EncodeItem()
    item.CopyFrom(good)
    if case == "content_hash":
        item.content_hash = BAD_HASH
    elif case == "grid_thw":
        del item.grid_thw[:]
        item.grid_thw.extend([1, 4])
    elif case == "grid_merge":
        item.grid_thw[1] = 3
    elif case == "pixel_values":
        item.pixel_values.shape[0] -= 1
    elif case == "missing_pixels":
        item.ClearField("pixel_values")
    elif case == "partition_indices":
        item.partition_indices.extend([0, 7])
    elif case == "partition_order":
        item.partition_indices.extend([2, 1])
    elif case == "partitions_gap":
        item.partitions[1].input_start += 16
    elif case == "output_rows":
        item.partitions[0].output_rows += 1
    elif case == "partition_hash":
        item.partitions[2].content_hash = BAD_HASH
    elif case == "modality":
        item.modality = multimodal_pb2.MODALITY_AUDIO
    return item


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("content_hash", "content_hash"),
        ("grid_thw", "grid_thw"),
        ("grid_merge", "grid_thw"),
        ("pixel_values", "pixel_values"),
        ("missing_pixels", "pixel_values"),
        ("partition_indices", "partition_indices"),
        ("partition_order", "partition_indices"),
        ("partitions_gap", "partitions[1].input_start"),
        ("output_rows", "partitions[0].output_rows"),
        ("partition_hash", "partitions[2].content_hash"),
        ("modality", "modality"),
    ],
)
async def test_malformed_input_is_refused_and_caches_nothing(
    make_server: Factory, processor: Processor, case: str, field: str
) -> None:
    server, stub = await make_server()
    good_image = _item(_image(processor, 30))
    bad = _malformed(case, _item(_video(processor, 31)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(_request(good_image, bad), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details() and "item 1" in info.value.details()
    engine = _engine(server)
    assert len(engine.cache) == 0 and engine.forward_calls == 0
    assert (await stub.Encode(_request(good_image), timeout=30)).items[0].rows.shape


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

        # A reader that never releases: the lease expires.
        await stub.Encode(_request(_item(other)), timeout=60)
        assert len(leases) == 1
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
    with pytest.raises(SettingsError, match="output_pool_mb"):
        EncoderSettings(output_pool_mb=-1, security=secure).check()
    with pytest.raises(SettingsError, match=r"security\.cluster_token_file"):
        EncoderSettings().check()  # the encoder, too, refuses to run without the token


@pytest.fixture
def free_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port


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
