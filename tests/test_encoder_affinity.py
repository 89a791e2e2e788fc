"""Encoder choice by item-hash affinity + load, in-process against fake encoders.

Encoders register under fixed names, so each item's rendezvous home is fixed by its content
hash and the names alone (not by the free ports the fakes got); tests compute the expected
home with `rendezvous_weight` and check the router sent the item there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from common.models.tiny import make_tiny_checkpoint
from common.roles import Role
from common.sampling import SamplingParams
from common.server.rpc import start_server
from epd.client import GenerateError
from epd.v1 import encoder_service_pb2_grpc, registry_service_pb2
from router.registry import Registry
from router.server import serve
from router.settings import RouterSettings
from router.workers import WorkerLoad, rendezvous_weight
from tests.cluster import cluster_security
from tests.test_router import (
    MODEL,
    Cluster,
    FakeDecode,
    FakeEncoder,
    FakePrefill,
    chat,
    png,
    worker_info,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


class NamedEncoder(FakeEncoder):
    """A fake encoder whose lease ids carry its name (real ones are unique uuids)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.address = ""
        self.fail: grpc.StatusCode | None = None
        self.fail_after_s = 0.0  # wait this long before failing

    async def Encode(self, request, context):
        if self.fail is not None:
            self.requests.append(request)
            await asyncio.sleep(self.fail_after_s)
            await context.abort(self.fail, "fake encoder failure")
        out = await super().Encode(request, context)
        for item in out.items:
            for ref in (item.rows, *item.deepstack):
                if ref.WhichOneof("data") == "handle":
                    ref.handle.lease_id = f"{self.name}-{ref.handle.lease_id}"
        return out

    @property
    def hashes(self) -> list[bytes]:
        return [item.content_hash for r in self.requests for item in r.items]


class AffinityCluster(Cluster):
    """The router with one fake prefill and decode worker; encoders come per test."""

    prefill: FakePrefill


async def start(ckpt: Any, slack: int = 2) -> AffinityCluster:
    settings = RouterSettings(
        model=str(ckpt),
        port=0,
        http_port=-1,
        expected_model=MODEL,
        worker_timeout_s=60.0,
        encoder_affinity_slack=slack,
        embedding_cache_mb=0,  # every request reaches an encoder: these tests count them
        security=cluster_security(),
    )
    cluster = AffinityCluster(await serve(settings))
    cluster.prefill = FakePrefill()
    await cluster.add(Role.PREFILL, cluster.prefill)
    await cluster.add(Role.DECODE, FakeDecode())
    return cluster


async def add_encoder(cluster: Cluster, name: str) -> NamedEncoder:
    enc = NamedEncoder(name)
    server = await start_server(
        [lambda s: encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server(enc, s)]
    )
    cluster.servers.append(server)
    enc.address = server.address
    info = worker_info(Role.ENCODER, server.address)
    info.name = name
    await cluster.registry_stub.Register(registry_service_pb2.RegisterRequest(worker=info))
    return enc


@pytest.fixture
async def make_cluster(ckpt):
    made: list[AffinityCluster] = []

    async def make(slack: int = 2) -> AffinityCluster:
        made.append(await start(ckpt, slack))
        return made[-1]

    yield make
    for cluster in made:
        await cluster.close()


def registry(cluster: Cluster) -> Registry:
    assert cluster.router.orchestrator is not None
    return cluster.router.orchestrator.registry


def item_hash(cluster: Cluster, seed: int) -> bytes:
    assert cluster.router.orchestrator is not None
    prompt = cluster.router.orchestrator.processor.process(image(seed))
    return prompt.params.items[0].content_hash


def home(key: bytes, encoders: list[NamedEncoder]) -> NamedEncoder:
    return max(encoders, key=lambda e: rendezvous_weight(key, e.name))


def image(*seeds: int) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": png(s)} for s in seeds]
    return chat(*parts, {"type": "text", "text": "What is it?"})


def set_load(cluster: Cluster, enc: NamedEncoder, active: int) -> None:
    (record,) = [w for w in registry(cluster).workers(Role.ENCODER) if w.address == enc.address]
    assert registry(cluster).heartbeat(record.worker_id, WorkerLoad(active_requests=active))


async def ask(cluster: Cluster, *seeds: int) -> None:
    result = await cluster.client.generate_text(image(*seeds), SamplingParams(max_tokens=2))
    assert len(result.token_ids) == 2


def owners(encoders: list[NamedEncoder]) -> dict[bytes, set[str]]:
    out: dict[bytes, set[str]] = {}
    for enc in encoders:
        for h in enc.hashes:
            out.setdefault(h, set()).add(enc.name)
    return out


SEEDS = range(10, 20)


async def test_the_same_item_goes_to_its_home_encoder_every_time(make_cluster):
    cluster = await make_cluster()
    encoders = [await add_encoder(cluster, f"enc-{k}") for k in range(2)]
    for _ in range(2):
        for seed in SEEDS:
            await ask(cluster, seed)
    got = owners(encoders)
    assert len(got) == len(SEEDS)
    for seed in SEEDS:
        h = item_hash(cluster, seed)
        assert got[h] == {home(h, encoders).name}
    assert all(len(e.requests) >= 2 for e in encoders)  # both get items


async def test_an_encoder_joining_or_leaving_moves_only_its_items(make_cluster):
    cluster = await make_cluster()
    encoders = [await add_encoder(cluster, f"enc-{k}") for k in range(2)]
    for seed in SEEDS:
        await ask(cluster, seed)
    before = {h: next(iter(names)) for h, names in owners(encoders).items()}

    third = await add_encoder(cluster, "enc-2")
    for enc in encoders:
        enc.requests.clear()
    for seed in SEEDS:
        await ask(cluster, seed)
    after = {h: next(iter(names)) for h, names in owners([*encoders, third]).items()}
    moved = {h for h in before if after[h] != before[h]}
    assert moved, "the new encoder should win some items"
    assert moved != set(before), "only some items move"
    assert {after[h] for h in moved} == {"enc-2"}
    assert moved == {h for h in before if home(h, [*encoders, third]) is third}

    # Draining a worker moves only its items back, each to its old home.
    registry(cluster).drain(third.address)
    for enc in [*encoders, third]:
        enc.requests.clear()
    for seed in SEEDS:
        await ask(cluster, seed)
    again = {h: next(iter(names)) for h, names in owners([*encoders, third]).items()}
    assert again == before


async def test_a_busy_home_is_bypassed_for_the_least_loaded(make_cluster):
    cluster = await make_cluster(slack=2)
    encoders = [await add_encoder(cluster, f"enc-{k}") for k in range(3)]
    h = item_hash(cluster, 7)
    first, second, third = sorted(encoders, key=lambda e: -rendezvous_weight(h, e.name))
    # The rendezvous runner-up is busier than the least loaded: the least loaded wins.
    set_load(cluster, first, 3)
    set_load(cluster, second, 1)
    await ask(cluster, 7)
    assert owners(encoders) == {h: {third.name}}

    for enc in encoders:
        enc.requests.clear()
    set_load(cluster, first, 2)  # within the slack of the least loaded: home again
    await ask(cluster, 7)
    assert owners(encoders) == {h: {first.name}}


async def test_slack_zero_is_least_loaded_whole_requests(make_cluster):
    cluster = await make_cluster(slack=0)
    encoders = [await add_encoder(cluster, f"enc-{k}") for k in range(2)]
    for _ in range(4):
        await ask(cluster, 7)
    assert [len(e.requests) for e in encoders] == [2, 2]  # ties alternate: no affinity
    for enc in encoders:
        enc.requests.clear()
    set_load(cluster, encoders[0], 1)
    await ask(cluster, *SEEDS[:4])
    assert [len(e.requests) for e in encoders] == [0, 1]
    assert len(encoders[1].requests[0].items) == 4  # the whole request, to one encoder


def split_seeds(cluster: Cluster, encoders: list[NamedEncoder]) -> list[int]:
    """Four seeds whose homes alternate between the two encoders: a, b, a, b."""
    by_home: dict[str, list[int]] = {}
    for seed in range(30, 60):
        by_home.setdefault(home(item_hash(cluster, seed), encoders).name, []).append(seed)
    a, b = (by_home[e.name] for e in encoders)
    return [a[0], b[0], a[1], b[1]]


async def test_items_split_over_encoders_keep_order_and_holders(make_cluster):
    cluster = await make_cluster()
    encoders = [await add_encoder(cluster, f"enc-{k}") for k in range(2)]
    for enc in encoders:
        enc.handles = True
    seeds = split_seeds(cluster, encoders)
    await ask(cluster, *seeds)
    assert [len(e.requests) for e in encoders] == [1, 1]  # one call per encoder
    (request,) = cluster.prefill.requests
    hashes = list(request.multimodal.mm_hashes)
    assert hashes == [item_hash(cluster, s) for s in seeds]
    embeddings = request.multimodal.embeddings
    assert [e.item_index for e in embeddings] == [0, 1, 2, 3]
    holders = dict(request.embedding_holders)
    for index, emb in enumerate(embeddings):
        enc = home(hashes[index], encoders)
        position = enc.hashes.index(hashes[index])  # where in its call the item was
        assert emb.rows.handle.lease_id == f"{enc.name}-emb-{position}-0"
        assert [d.handle.lease_id for d in emb.deepstack] == [
            f"{enc.name}-emb-{position}-{k}" for k in (1, 2)
        ]
        for ref in (emb.rows, *emb.deepstack):
            assert holders[ref.handle.lease_id] == enc.address
    assert len(holders) == 12


async def test_a_failed_group_fails_the_request_and_frees_the_others_leases(make_cluster):
    cluster = await make_cluster()
    encoders = [await add_encoder(cluster, f"enc-{k}") for k in range(2)]
    good, bad = encoders
    good.handles = True
    bad.fail = grpc.StatusCode.INTERNAL
    bad.fail_after_s = 0.3  # after the good encoder has answered and granted leases
    seeds = split_seeds(cluster, encoders)
    with pytest.raises(GenerateError) as err:
        await ask(cluster, *seeds)
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert "fake encoder failure" in err.value.details
    assert cluster.prefill.requests == []
    for _ in range(100):
        if good.released:
            break
        await asyncio.sleep(0.02)
    assert sorted(good.released) == sorted(f"enc-0-emb-{p}-{k}" for p in range(2) for k in range(3))
