"""The router in-process against fake encoder / prefill / decode workers: the fakes, and the
plain text path.

The fakes are real gRPC servers on 127.0.0.1 that record what they get and can be told to
hang or fail; they, the router of these tests (`start_router`, the `ckpt` / `cluster` /
`workers` fixtures) and the request helpers serve the `tests.test_router_*` modules (and
others). Here: a text request goes prefill then decode with the lease taken over by decode,
and the router's text is its detokenization of every token (deltas never split a character).
The router uses the real processor of a tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from typing import Any

import grpc
import numpy as np
import pytest
from PIL import Image

from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from common.models.tiny import make_tiny_checkpoint
from common.processing.messages import messages_from_dicts
from common.processing.processor import Processor
from common.roles import EMBEDDING_DIGESTS, PATCH_CODES, SIGNED_KV, Role
from common.sampling import SamplingParams
from common.server.rpc import channel, start_server
from common.wire.kv import layout_from_proto
from common.wire.roles import role_to_proto
from epd.client import Client
from epd.v1 import (
    admin_service_pb2_grpc,
    decode_service_pb2,
    decode_service_pb2_grpc,
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    kv_pb2,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    registry_service_pb2,
    registry_service_pb2_grpc,
    tensor_pb2,
)
from router.detokenize import IncrementalDetokenizer
from router.server import RunningRouter, serve
from router.settings import RouterSettings
from router.tenants import tenant_salt
from tests.cluster import (
    CLIENT_KEY,
    cluster_credentials,
    cluster_security,
)

MODEL = "fake-model"
FIRST = 100  # the fake prefill's first token


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


async def hang(cancelled: asyncio.Event) -> None:
    """A fake worker's call that never answers: wait until it is cancelled, and say so."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.set()
        raise


class FakeEncoder(encoder_service_pb2_grpc.EncoderServiceServicer):
    def __init__(self) -> None:
        self.requests: list[encoder_service_pb2.EncodeRequest] = []
        self.released: list[str] = []
        self.handles = False  # answer with NIXL handles instead of inline rows
        self.hang = False
        self.cancelled = asyncio.Event()

    async def Encode(self, request, context):
        self.requests.append(request)
        if self.hang:
            await hang(self.cancelled)
        out = encoder_service_pb2.EncodeResponse()
        for i, item in enumerate(request.items):
            rows = sum(p.output_rows for p in item.partitions) or int(np.prod(item.grid_thw)) // 4
            refs = []
            for k in range(3):
                ref = tensor_pb2.TensorRef(dtype=tensor_pb2.ELEMENT_TYPE_FLOAT32, shape=[rows, 64])
                if self.handles:
                    ref.handle.lease_id = f"emb-{i}-{k}"
                    ref.handle.length = rows * 64 * 4
                else:
                    ref.inline_data = bytes(rows * 64 * 4)
                refs.append(ref)
            out.items.add(content_hash=item.content_hash, rows=refs[0], deepstack=refs[1:])
        return out

    async def ReleaseEmbeddings(self, request, context):
        self.released.extend(request.lease_ids)
        return encoder_service_pb2.ReleaseEmbeddingsResponse(released=len(request.lease_ids))


class FakePrefill(prefill_service_pb2_grpc.PrefillServiceServicer):
    def __init__(self) -> None:
        self.address = ""
        self.requests: list[prefill_service_pb2.PrefillRequest] = []
        self.released: list[str] = []
        self.hang = False
        self.fail: grpc.StatusCode | None = None
        self.cancelled = asyncio.Event()
        self.first = FIRST
        self.cached: list[bytes] = []  # hashes announced by StreamKvEvents
        self.strict = False  # refuse items without embeddings, as after an eviction
        self.lease_ttl_ms = 0  # the handles' (0: none said)

    async def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "fake failure")
        mm = request.multimodal
        if self.strict and len(mm.embeddings) < len(mm.mm_hashes):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "carries no embeddings")
        if self.hang:
            await hang(self.cancelled)
        lease = f"lease-{len(self.requests)}"
        kv = kv_pb2.KvHandle(lease_id=lease, holder_address=self.address, block_hashes=[b"h"])
        kv.lease_ttl_ms = self.lease_ttl_ms
        return prefill_service_pb2.PrefillResponse(first_token_id=self.first, kv=kv)

    async def ReleaseKv(self, request, context):
        self.released.append(request.lease_id)
        return prefill_service_pb2.ReleaseKvResponse(released=True)

    async def StreamKvEvents(self, request, context):
        snapshot = kv_pb2.KvEvent(kind=kv_pb2.KV_EVENT_KIND_STORED, block_hashes=self.cached)
        yield prefill_service_pb2.StreamKvEventsResponse(events=[snapshot])
        await asyncio.Event().wait()


class FakeDecode(decode_service_pb2_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.requests: list[decode_service_pb2.DecodeRequest] = []
        self.hang_before_first = False
        self.hang_after_first = False
        self.fail: grpc.StatusCode | None = None
        self.fail_details = "fake decode failure"
        self.refuse_kv = 0  # answer this many calls ABORTED, as when the KV fails its checks
        self.per_chunk = 1  # tokens a chunk carries after the first (a worker's stream_interval)
        self.first_id = 101  # the answer's second token; each later one is one more
        self.linger_s = 0.0  # between the last chunk and the status (a busy worker)
        self.cancelled = asyncio.Event()

    async def Decode(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, self.fail_details)
        if self.refuse_kv:
            self.refuse_kv -= 1
            await context.abort(grpc.StatusCode.ABORTED, "kv.block_digests: prefill again")
        try:
            if self.hang_before_first:
                await asyncio.sleep(60)
            left = request.sampling.max_tokens - 1
            # As the real worker: the tokens after the first one (never an echo of it), the
            # last chunk with a finish reason.
            done = left <= 1
            yield decode_service_pb2.DecodeResponse(
                token_ids=[self.first_id] if left >= 1 else [],
                finish_reason=decode_service_pb2.FINISH_REASON_LENGTH if done else 0,
                blocks_pulled=3,
            )
            if self.hang_after_first:
                await asyncio.sleep(60)
            rest = [] if done else [self.first_id + 1 + i for i in range(left - 1)]
            stops = [k for k, t in enumerate(rest) if t in request.sampling.stop_token_ids]
            rest = rest[: stops[0] + 1] if stops else rest  # a stop token ends the answer
            finish = (
                decode_service_pb2.FINISH_REASON_STOP
                if stops
                else decode_service_pb2.FINISH_REASON_LENGTH
            )
            for at in range(0, len(rest), self.per_chunk):
                last = at + self.per_chunk >= len(rest)
                yield decode_service_pb2.DecodeResponse(
                    token_ids=rest[at : at + self.per_chunk], finish_reason=finish if last else 0
                )
            await asyncio.sleep(self.linger_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def worker_info(role: Role, address: str, **kw: Any) -> registry_service_pb2.WorkerInfo:
    msg = registry_service_pb2.WorkerInfo(
        role=role_to_proto(role), address=address, model=MODEL, protocol_version="epd.v1"
    )
    if role == Role.ENCODER:  # a current encoder's (older ones take float32 values)
        msg.capabilities.extend(kw.get("capabilities", [PATCH_CODES, EMBEDDING_DIGESTS]))
    else:
        msg.capabilities.append(SIGNED_KV)
        msg.kv_layout.CopyFrom(
            kv_pb2.KvLayout(
                model=MODEL,
                dtype=tensor_pb2.ELEMENT_TYPE_FLOAT32,
                block_size=kw.get("block_size", 16),
                num_layers=2,
                num_kv_heads=2,
                head_dim=16,
                layout="block-major",
                block_bytes=16384,
            )
        )
    return msg


class Cluster:
    """A router plus fake workers, all in this event loop."""

    def __init__(self, router: RunningRouter) -> None:
        self.router = router
        self.servers: list[Any] = []
        # The fake workers register as services of the deployment (the cluster bearer).
        self.channel = channel(router.address, credentials=cluster_credentials())
        self.registry_stub = registry_service_pb2_grpc.RegistryServiceStub(self.channel)
        self.admin = admin_service_pb2_grpc.AdminServiceStub(self.channel)
        self.client = Client(router.address, api_key=CLIENT_KEY)

    async def add(self, role: Role, servicer: Any) -> str:
        adders = {
            Role.ENCODER: encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server,
            Role.PREFILL: prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server,
            Role.DECODE: decode_service_pb2_grpc.add_DecodeServiceServicer_to_server,
        }
        server = await start_server([lambda s: adders[role](servicer, s)])
        self.servers.append(server)
        if isinstance(servicer, FakePrefill):
            servicer.address = server.address
        await self.registry_stub.Register(
            registry_service_pb2.RegisterRequest(worker=worker_info(role, server.address))
        )
        return server.address

    async def close(self) -> None:
        await self.client.close()
        await self.channel.close()
        await self.router.stop(0)
        for server in self.servers:
            await server.stop(0)


async def start_router(ckpt: Any, **overrides: Any) -> Cluster:
    """The router of these tests (settings `overrides` on top), no workers yet."""
    base: dict[str, Any] = {
        "model": str(ckpt),
        "port": 0,
        "http_port": -1,
        "expected_model": MODEL,
        "worker_timeout_s": 60.0,
        "security": cluster_security(),
    }
    settings = RouterSettings(**(base | overrides))
    return Cluster(await serve(settings))


@pytest.fixture
async def cluster(ckpt):
    c = await start_router(ckpt)
    yield c
    await c.close()


@pytest.fixture
async def workers(cluster):
    enc, pre, dec = FakeEncoder(), FakePrefill(), FakeDecode()
    await cluster.add(Role.ENCODER, enc)
    await cluster.add(Role.PREFILL, pre)
    await cluster.add(Role.DECODE, dec)
    return enc, pre, dec


def png(seed: int, w: int = 64, h: int = 48) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def chat(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


TEXT = chat({"type": "text", "text": "Describe the weather."})
IMAGE = chat({"type": "image", "image": png(1)}, {"type": "text", "text": "What is it?"})


async def test_text_request_goes_prefill_then_decode(cluster, workers):
    enc, pre, dec = workers
    chunks = [c async for c in cluster.client.generate(TEXT, SamplingParams(max_tokens=4))]
    assert [c.token_ids for c in chunks] == [(FIRST,), (101,), (102,), (103,)]
    assert chunks[0].prompt_tokens > 0 and chunks[1].blocks_pulled == 3
    assert chunks[-1].finish_reason == "length"
    assert enc.requests == []  # text needs no encoder
    assert list(pre.requests[0].prompt_token_ids) == list(dec.requests[0].prompt_token_ids)
    assert dec.requests[0].first_token_id == FIRST
    assert dec.requests[0].kv.lease_id == "lease-1"
    assert pre.requests[0].sampling.max_tokens == 4
    for _ in range(25):  # the decode worker took the lease over: no release comes (0.5 s)
        assert pre.released == []
        await asyncio.sleep(0.02)


def prompt_hashes(cluster: Cluster, messages: Any) -> tuple[Any, list[bytes]]:
    assert cluster.router.orchestrator is not None
    prompt = cluster.router.orchestrator.processor.process(messages_from_dicts(messages))
    layout = layout_from_proto(worker_info(Role.PREFILL, "x").kv_layout)
    # The router salts every hash with the client's tenant (tenant-a: `cluster.client`'s).
    salt = tenant_salt(cluster_security().cluster_key(), "tenant-a", None)
    hashes = block_hashes(
        prompt.prompt_token_ids, 16, prompt.params, cache_salt=salt, root=layout_root(layout)
    )
    return prompt, hashes


async def test_affinity_slacks_reach_the_routing_they_set(ckpt) -> None:
    # Their wiring could be cut without a test failing: they would set nothing (s35diff).
    cluster = await start_router(ckpt, kv_affinity_slack=0, encoder_affinity_slack=5)
    try:
        orchestrator = cluster.router.orchestrator
        assert orchestrator is not None
        assert (orchestrator.routing.slack, orchestrator.encoder.affinity_slack) == (0, 5)
    finally:
        await cluster.close()


async def test_a_tenants_cache_epoch_salts_everything_it_sends(ckpt, tmp_path) -> None:
    # A new epoch is how an operator leaves a tenant's caches behind (its name given to
    # someone else): with the router salting without it every test passed (mutation review).
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nkey = "{CLIENT_KEY}"\ntenant = "tenant-a"\ncache_epoch = "7"\n')
    keys.chmod(0o600)
    security = dataclasses.replace(cluster_security(), api_keys_file=str(keys))
    cluster = await start_router(ckpt, security=security)
    try:
        enc, pre = FakeEncoder(), FakePrefill()
        await cluster.add(Role.ENCODER, enc)
        await cluster.add(Role.PREFILL, pre)
        await cluster.add(Role.DECODE, FakeDecode())
        await cluster.client.generate_text(IMAGE, SamplingParams(max_tokens=2))
    finally:
        await cluster.close()
    key = cluster_security().cluster_key()
    want = tenant_salt(key, "tenant-a", None, "7")
    assert want != tenant_salt(key, "tenant-a", None)
    assert pre.requests[-1].cache_salt == want and enc.requests[-1].cache_salt == want


# ------------------------------------------------------------------------------- text


async def test_text_is_the_routers_detokenization_of_every_token(cluster, workers):
    # The decode stream carries token ids only; the router's text covers the first token too.
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert result.token_ids == [FIRST, 101, 102, 103]
    assert result.text == cluster.router.orchestrator.processor.decode(result.token_ids)


def test_detokenizer_deltas_concatenate_to_the_full_text(ckpt):
    processor = Processor.from_pretrained(ckpt)
    ids = processor.tokenizer.encode("héllo wörld — ünïcode ✓ text, and more").ids
    detok = IncrementalDetokenizer(processor.decode)
    deltas = [detok.add([t]) for t in ids]
    assert "\ufffd" not in "".join(deltas)  # a split character is held back, never sent
    assert "".join(deltas) + detok.flush() == processor.decode(ids)
