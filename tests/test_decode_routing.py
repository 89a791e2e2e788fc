"""Decode routing by cached overlap (`router.routing`): decode workers publish KV events
like prefill workers, the router sends a request to the decode worker holding the longest
prefix among the least loaded, and that worker pulls only what it lacks.

The choice itself is checked on the real `Registry` and `PrefixIndex` (events applied as
the router's stream would); the whole path on a real deployment with two decode workers,
where the least-recently-picked tie-break alone would move every second turn away.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from PIL import Image

from common.engine import Engine
from common.kv.hashing import block_hashes
from common.models.tiny import make_tiny_checkpoint
from common.roles import SIGNED_KV, Role
from common.sampling import SamplingParams
from common.server.auth import service_credentials
from common.server.rpc import channel
from common.wire.roles import role_to_proto
from epd.client import Client
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    kv_pb2,
    registry_service_pb2,
    tensor_pb2,
)
from router.prefix_index import PrefixIndex
from router.registry import Registry
from router.routing import PrefillRouting
from tests.cluster import ROLES, Cluster, start_cluster

BLOCK = 8
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


# --- the choice, on the router's own registry and prefix index ----------------------------


def kv_info(role: Role, port: int) -> registry_service_pb2.WorkerInfo:
    info = registry_service_pb2.WorkerInfo(
        role=role_to_proto(role),
        address=f"127.0.0.1:{port}",
        model="m",
        protocol_version="epd.v1",
        name=f"{role}-{port}",
        capabilities=[SIGNED_KV],
    )
    info.kv_layout.CopyFrom(
        kv_pb2.KvLayout(
            model="m",
            dtype=tensor_pb2.ELEMENT_TYPE_FLOAT32,
            block_size=BLOCK,
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
            layout="block-major/layer,kv,token,head,dim",
            block_bytes=8192,
        )
    )
    return info


def stored(*hashes: bytes) -> list[kv_pb2.KvEvent]:
    return [kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=list(hashes))]


def test_decode_goes_to_the_longest_cached_prefix_among_the_least_loaded() -> None:
    registry = Registry(worker_timeout_s=1e9, heartbeat_interval_s=1.0)
    registry.register(kv_info(Role.PREFILL, 9000))
    a, b = (registry.register(kv_info(Role.DECODE, port)) for port in (9001, 9002))
    prefix = PrefixIndex(channels=None)  # type: ignore[arg-type]  # events applied by hand
    hashes = [bytes([i]) * 32 for i in range(6)]
    prefix._apply(a.address, stored(*hashes[:2]))
    prefix._apply(b.address, stored(*hashes[:5]))
    choose = PrefillRouting(registry, prefix, cache_aware=True).chooser(hashes)
    for _ in range(3):  # not the least recently picked: the one holding more
        assert choose(Role.DECODE, frozenset()) is b
    assert choose(Role.DECODE, frozenset({b.address})) is a
    # Load beyond the slack (2 requests) wins over the cached prefix, as for prefill.
    with registry.using(b), registry.using(b):
        assert choose(Role.DECODE, frozenset()) is b
        with registry.using(b):
            assert choose(Role.DECODE, frozenset()) is a
    # The slack is a setting (kv_affinity_slack): 4 keeps b at 3 beyond a; 0, a tie only.
    wide = PrefillRouting(registry, prefix, cache_aware=True, slack=4).chooser(hashes)
    narrow = PrefillRouting(registry, prefix, cache_aware=True, slack=0).chooser(hashes)
    with registry.using(b):
        assert narrow(Role.DECODE, frozenset()) is a
        with registry.using(b), registry.using(b):
            assert wide(Role.DECODE, frozenset()) is b
    assert narrow(Role.DECODE, frozenset()) is b
    # Not cache aware (no hashes): by load alone, alternating between equals.
    by_load = PrefillRouting(registry, prefix, cache_aware=False).chooser(None)
    assert {by_load(Role.DECODE, frozenset()).address for _ in range(2)} == {a.address, b.address}


# --- the whole path: 2 decode workers ------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    c = start_cluster(ckpt, tmp_path_factory.mktemp("logs"), block_size=BLOCK, decodes=2)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def engine(ckpt: Any) -> Engine:
    return Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=256, max_batch=2)


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))


def turn(seed: int, history: list[dict[str, Any]], answer: str | None) -> list[dict[str, Any]]:
    """The conversation after `history`: its first user turn, or the next one."""
    if answer is None:
        image = {"type": "image", "image": picture(seed)}
        text = {"type": "text", "text": f"Chat {seed}: what is in this picture?"}
        return [{"role": "user", "content": [image, text]}]
    return [
        *history,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And which colour is there most of?"},
    ]


def shared_blocks(engine: Engine, first: Any, second: Any) -> int:
    """Leading full blocks the two prompts share (the tenant's salt changes every hash, not
    how many agree)."""
    pa, pb = engine.process(first), engine.process(second)
    ha = block_hashes(pa.prompt_token_ids, BLOCK, pa.params)
    hb = block_hashes(pb.prompt_token_ids, BLOCK, pb.params)
    return next((i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), len(ha))


@pytest.mark.slow
async def test_second_turns_go_to_the_decode_worker_holding_the_first(
    cluster: Cluster, engine: Engine
) -> None:
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        for seed in (1, 2):
            # Turns back to back: by load alone (the least recently picked of two idle
            # workers) every second turn would land on the other decode worker.
            first = turn(seed, [], None)
            answer = await client.generate_text(first, GREEDY, timeout_s=120)
            assert answer.blocks_reused == 0
            await asyncio.sleep(0.5)  # the decode worker's KV events reach the router
            second = turn(seed, first, answer.text)
            result = await client.generate_text(second, GREEDY, timeout_s=120)
            shared = shared_blocks(engine, first, second)
            assert shared >= 3
            # On the worker holding the first turn: it pulls only the blocks it lacks.
            assert result.blocks_reused == shared, seed
            assert result.blocks_pulled == -(-result.prompt_tokens // BLOCK) - shared
    # The conversations spread over both workers: each streams a snapshot holding blocks.
    status = await asyncio.to_thread(cluster.status)
    decoders = [w.info.address for w in status.workers if w.info.role == ROLES["decode"]]
    assert len(decoders) == 2
    for address in decoders:
        snapshot = await first_kv_message(cluster, address)
        assert [e.kind for e in snapshot.events] == [kv_pb2.KV_EVENT_KIND_STORED]
        assert len(snapshot.events[0].block_hashes) >= 3, address


async def first_kv_message(
    cluster: Cluster, address: str
) -> decode_service_pb2.StreamDecodeKvEventsResponse:
    """The first message of a decode worker's KV event stream (its snapshot)."""
    creds = service_credentials(cluster.security)
    async with channel(address, credentials=creds) as ch:
        stub = decode_service_pb2_grpc.DecodeServiceStub(ch)
        call = stub.StreamDecodeKvEvents(
            decode_service_pb2.StreamDecodeKvEventsRequest(subscriber="test")
        )
        try:
            message: decode_service_pb2.StreamDecodeKvEventsResponse = await asyncio.wait_for(
                call.read(), timeout=10
            )
            return message
        finally:
            call.cancel()
