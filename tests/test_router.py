"""The router in-process against fake encoder / prefill / decode workers.

The fakes are real gRPC servers on 127.0.0.1 that record what they get and can be told to
hang or fail, so the orchestration (E -> P -> D, pass-through of embeddings, lease release,
cancellation, deadlines, retries) and the admin service are checked without any model.
The router uses the real processor of a tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import io
import time
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
from common.roles import PATCH_CODES, Role
from common.sampling import SamplingParams
from common.server.rpc import channel, start_server
from common.wire.kv import layout_from_proto
from common.wire.roles import role_to_proto
from epd.client import Client, GenerateError, build_request
from epd.v1 import (
    admin_service_pb2,
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
from router.calls import Job
from router.detokenize import IncrementalDetokenizer
from router.server import RunningRouter, serve
from router.settings import RouterSettings
from router.tenants import tenant_salt
from tests.cluster import (
    CLIENT_KEY,
    OTHER_KEY,
    admin_credentials,
    cluster_credentials,
    cluster_security,
)

MODEL = "fake-model"
FIRST = 100  # the fake prefill's first token


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


class FakeEncoder(encoder_service_pb2_grpc.EncoderServiceServicer):
    def __init__(self) -> None:
        self.requests: list[encoder_service_pb2.EncodeRequest] = []
        self.released: list[str] = []
        self.handles = False  # answer with NIXL handles instead of inline rows

    async def Encode(self, request, context):
        self.requests.append(request)
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

    async def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "fake failure")
        mm = request.multimodal
        if self.strict and len(mm.embeddings) < len(mm.mm_hashes):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "carries no embeddings")
        if self.hang:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        lease = f"lease-{len(self.requests)}"
        kv = kv_pb2.KvHandle(lease_id=lease, holder_address=self.address, block_hashes=[b"h"])
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
        self.refuse_kv = 0  # answer this many calls ABORTED, as when the KV fails its checks
        self.per_chunk = 1  # tokens a chunk carries after the first (a worker's stream_interval)
        self.first_id = 101  # the answer's second token; each later one is one more
        self.cancelled = asyncio.Event()

    async def Decode(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "fake decode failure")
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
            for at in range(0, len(rest), self.per_chunk):
                last = at + self.per_chunk >= len(rest)
                yield decode_service_pb2.DecodeResponse(
                    token_ids=rest[at : at + self.per_chunk],
                    finish_reason=decode_service_pb2.FINISH_REASON_LENGTH if last else 0,
                )
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def worker_info(role: Role, address: str, **kw: Any) -> registry_service_pb2.WorkerInfo:
    msg = registry_service_pb2.WorkerInfo(
        role=role_to_proto(role), address=address, model=MODEL, protocol_version="epd.v1"
    )
    if role == Role.ENCODER:  # a current encoder's (older ones take float32 values)
        msg.capabilities.extend(kw.get("capabilities", [PATCH_CODES]))
    else:
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
    settings = RouterSettings(
        model=str(ckpt),
        port=0,
        http_port=-1,
        expected_model=MODEL,
        worker_timeout_s=60.0,
        grace_s=0.0,
        security=cluster_security(),
        **overrides,
    )
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
    await asyncio.sleep(0.05)
    assert pre.released == []  # the decode worker took the lease over


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


async def test_prefill_goes_to_the_worker_caching_the_prefix_and_skips_covered_items(cluster):
    enc, cold, dec = FakeEncoder(), FakePrefill(), FakeDecode()
    warm = FakePrefill()
    messages = chat({"type": "image", "image": png(3)}, {"type": "text", "text": "Again?"})
    prompt, hashes = prompt_hashes(cluster, messages)
    covered = 16 * min(len(hashes), (len(prompt.prompt_token_ids) - 1) // 16)
    assert prompt.params.items[0].end <= covered
    warm.cached = hashes
    for role, servicer in ((Role.ENCODER, enc), (Role.PREFILL, cold), (Role.DECODE, dec)):
        await cluster.add(role, servicer)
    await cluster.add(Role.PREFILL, warm)
    await asyncio.sleep(0.3)  # the router follows both workers' KV events
    for _ in range(2):
        await cluster.client.generate_text(messages, SamplingParams(max_tokens=2))
    assert len(warm.requests) == 2 and cold.requests == []
    assert enc.requests == []  # the image lies inside the cached prefix
    assert len(warm.requests[0].multimodal.embeddings) == 0


async def test_skipped_items_are_encoded_when_the_cache_moved_on(cluster):
    enc, pre, dec = FakeEncoder(), FakePrefill(), FakeDecode()
    messages = chat({"type": "image", "image": png(4)}, {"type": "text", "text": "Again?"})
    _, pre.cached = prompt_hashes(cluster, messages)
    pre.strict = True  # ... but it evicted them: it needs the embeddings
    for role, servicer in ((Role.ENCODER, enc), (Role.PREFILL, pre), (Role.DECODE, dec)):
        await cluster.add(role, servicer)
    await asyncio.sleep(0.3)
    result = await cluster.client.generate_text(messages, SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]
    assert len(pre.requests) == 2 and len(enc.requests) == 1
    assert len(pre.requests[1].multimodal.embeddings) == 1


async def test_image_embeddings_pass_through_to_prefill_only(cluster, workers):
    enc, pre, dec = workers
    result = await cluster.client.generate_text(IMAGE, SamplingParams(max_tokens=3))
    assert result.token_ids == [FIRST, 101, 102]
    (item,) = enc.requests[0].items
    assert pre.requests[0].multimodal.items[0].grid_thw == item.grid_thw
    assert pre.requests[0].multimodal.mm_hashes == [item.content_hash]
    assert list(item.grid_thw) and item.pixel_values.shape[0] == int(np.prod(item.grid_thw))
    emb = pre.requests[0].multimodal.embeddings[0]
    assert emb.item_index == 0 and len(emb.deepstack) == 2
    assert list(emb.rows.shape) == [pre.requests[0].multimodal.mm_lengths[0], 64]
    assert dec.requests[0].multimodal.mm_hashes == [item.content_hash]
    assert len(dec.requests[0].multimodal.embeddings) == 0  # decode never gets embeddings


async def test_nixl_handles_pass_through_with_their_holder(cluster, workers):
    enc, pre, _ = workers
    enc.handles = True
    encoder_address = (await cluster.admin.Status(admin_service_pb2.StatusRequest())).workers[0]
    await cluster.client.generate_text(IMAGE, SamplingParams(max_tokens=2))
    emb = pre.requests[0].multimodal.embeddings[0]
    assert emb.rows.handle.lease_id == "emb-0-0"  # unchanged: prefill pulls from the encoder
    assert dict(pre.requests[0].embedding_holders) == {
        f"emb-0-{k}": encoder_address.info.address for k in range(3)
    }
    assert enc.released == []  # the prefill worker releases what it pulled


async def test_embedding_leases_are_released_when_prefill_fails(cluster, workers):
    enc, pre, _ = workers
    enc.handles = True
    pre.fail = grpc.StatusCode.INTERNAL
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(IMAGE)
    assert err.value.code == grpc.StatusCode.INTERNAL
    for _ in range(100):
        if enc.released:
            break
        await asyncio.sleep(0.02)
    assert sorted(enc.released) == ["emb-0-0", "emb-0-1", "emb-0-2"]


@pytest.mark.parametrize(
    ("messages", "sampling", "field"),
    [
        (chat({"type": "image", "image": b"not an image"}), None, "messages[0].content[0].image"),
        (
            chat({"type": "video", "video": [png(1), png(2, 32, 32)], "fps": 2.0}),
            None,
            "messages[0].content[0].video.frames",
        ),
        (TEXT, SamplingParams(max_tokens=2, top_k=0), None),
    ],
)
async def test_malformed_input_is_invalid_argument(cluster, workers, messages, sampling, field):
    enc, pre, _ = workers
    if field is None:  # a sampling error: build a bad request by hand
        request = build_request(messages, sampling)
        request.sampling.temperature = -1.0
        stub_call = cluster.client._router.Generate(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub_call:
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling" in info.value.details()
    else:
        with pytest.raises(GenerateError) as err:
            await cluster.client.generate_text(messages)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details
    assert enc.requests == [] and pre.requests == []
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]  # still serving


async def test_messages_the_processor_refuses_are_invalid_argument(cluster, workers):
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "too late"}]
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(bad)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages" in err.value.details


async def test_limits_refuse_before_any_worker_is_called(cluster, workers):
    enc, pre, dec = workers
    huge = [{"role": "user", "content": [{"type": "text", "text": "x" * 1_200_000}]}]
    attacks = {
        "sampling.max_tokens": (IMAGE, SamplingParams(max_tokens=2**32 - 1)),
        "messages[0].content[0].text": (huge, SamplingParams()),
    }
    for field, (messages, sampling) in attacks.items():
        with pytest.raises(GenerateError) as err:
            await cluster.client.generate_text(messages, sampling)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details.startswith(field)
    assert enc.requests == [] and pre.requests == [] and dec.requests == []


async def test_no_workers_is_unavailable(cluster):
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no prefill worker" in err.value.details


async def test_first_token_eos_skips_decode_and_releases(cluster, workers, ckpt):
    _, pre, dec = workers
    pre.first = cluster.router.orchestrator.processor.eos_token_ids[0]
    result = await cluster.client.generate_text(TEXT)
    assert result.finish_reason == "stop" and len(result.token_ids) == 1
    assert dec.requests == []
    await asyncio.sleep(0.1)
    assert pre.released == ["lease-1"]


async def test_decode_failure_releases_the_lease(cluster, workers):
    _, pre, dec = workers
    dec.fail = grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "fake decode failure" in err.value.details
    await asyncio.sleep(0.1)
    assert pre.released == ["lease-1"]


async def test_kv_refused_by_decode_is_prefilled_again(cluster, workers):
    _, pre, dec = workers
    dec.refuse_kv = 2
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert result.token_ids == [FIRST, 101, 102, 103]  # the client saw no error
    assert len(pre.requests) == 3  # the first prefill and two more
    # Each decode try got the newest handle and the first token already streamed.
    assert [r.kv.lease_id for r in dec.requests] == ["lease-1", "lease-2", "lease-3"]
    assert {r.first_token_id for r in dec.requests} == {FIRST}
    await asyncio.sleep(0.1)
    assert {"lease-1", "lease-2"} <= set(pre.released)


async def test_kv_refused_past_the_reprefills_is_aborted(cluster, workers):
    _, pre, dec = workers
    dec.refuse_kv = 3
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert err.value.code == grpc.StatusCode.ABORTED
    assert len(pre.requests) == 3


async def test_unavailable_worker_is_retried_on_another(cluster, workers):
    _, pre, _ = workers
    pre.fail = grpc.StatusCode.UNAVAILABLE
    other = FakePrefill()
    await cluster.add(Role.PREFILL, other)
    for _ in range(2):
        result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=2))
        assert result.token_ids == [FIRST, 101]
    assert len(other.requests) == 2


async def test_cancel_during_prefill_cancels_the_prefill_call(cluster, workers):
    _, pre, _ = workers
    pre.hang = True
    task = asyncio.create_task(cluster.client.generate_text(TEXT))
    while not pre.requests:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait_for(pre.cancelled.wait(), 5)


async def test_cancel_before_decode_answers_releases_and_cancels(cluster, workers):
    _, pre, dec = workers
    dec.hang_before_first = True
    task = asyncio.create_task(cluster.client.generate_text(TEXT))
    while not dec.requests:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait_for(dec.cancelled.wait(), 5)
    for _ in range(100):
        if pre.released:
            break
        await asyncio.sleep(0.02)
    assert pre.released == ["lease-1"]


async def test_closing_after_the_first_token_releases_the_lease(cluster, workers, ckpt):
    # The client may go away while the router still sits at the first `yield`, before
    # decode starts: the router owns the lease then and must release it.
    _, pre, dec = workers
    orchestrator = cluster.router.orchestrator
    prompt = orchestrator.processor.process(messages_from_dicts(TEXT))
    job = Job("r1", prompt, SamplingParams(max_tokens=4), None, time.monotonic() + 30)
    stream = orchestrator.run(job)
    first = await anext(stream)
    assert list(first.token_ids) == [FIRST]
    await stream.aclose()
    for _ in range(100):
        if pre.released:
            break
        await asyncio.sleep(0.02)
    assert pre.released == ["lease-1"] and dec.requests == []


async def test_cancel_mid_stream_cancels_decode(cluster, workers):
    _, pre, dec = workers
    dec.hang_after_first = True
    stream = cluster.client.generate(TEXT, SamplingParams(max_tokens=8))
    got = [await anext(stream), await anext(stream)]
    assert got[1].token_ids == (101,)
    await stream.aclose()
    await asyncio.wait_for(dec.cancelled.wait(), 5)
    assert pre.released == []  # the decode worker owns the lease by now


async def test_deadline_cancels_in_flight_work(cluster, workers):
    _, pre, _ = workers
    pre.hang = True
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, timeout_s=0.5)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(pre.cancelled.wait(), 5)


async def test_admin_status_drain_and_scale(cluster, workers):
    status = await cluster.admin.Status(admin_service_pb2.StatusRequest())
    assert [w.info.role for w in status.workers] == [
        registry_service_pb2.WORKER_ROLE_ENCODER,
        registry_service_pb2.WORKER_ROLE_PREFILL,
        registry_service_pb2.WORKER_ROLE_DECODE,
    ]
    assert status.model == MODEL
    decode_address = status.workers[2].info.address
    drained = await cluster.admin.Drain(admin_service_pb2.DrainRequest(address=decode_address))
    assert drained.found
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE  # the only decode worker drains
    status = await cluster.admin.Status(
        admin_service_pb2.StatusRequest(role=registry_service_pb2.WORKER_ROLE_DECODE)
    )
    assert [w.draining for w in status.workers] == [True]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.admin.Scale(
            admin_service_pb2.ScaleRequest(role=registry_service_pb2.WORKER_ROLE_DECODE)
        )
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Ray" in info.value.details()


async def test_scale_delegates_to_the_scaler(ckpt):
    calls = []

    async def scaler(role: Role, replicas: int) -> int:
        calls.append((role, replicas))
        return replicas

    settings = RouterSettings(
        model=str(ckpt),
        port=0,
        http_port=-1,
        expected_model=MODEL,
        grace_s=0.0,
        security=cluster_security(),
    )
    router = await serve(settings, scaler=scaler)
    try:
        async with channel(router.address, credentials=admin_credentials()) as ch:
            admin = admin_service_pb2_grpc.AdminServiceStub(ch)
            reply = await admin.Scale(
                admin_service_pb2.ScaleRequest(
                    role=registry_service_pb2.WORKER_ROLE_PREFILL, replicas=3
                )
            )
    finally:
        await router.stop(0)
    assert reply.replicas == 3 and calls == [(Role.PREFILL, 3)]


async def test_mismatched_registration_is_failed_precondition(cluster, workers):
    info = worker_info(Role.DECODE, "127.0.0.1:1", block_size=8)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.registry_stub.Register(registry_service_pb2.RegisterRequest(worker=info))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size=8 (expected 16)" in err.value.details()


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


async def test_an_image_seen_again_goes_to_prefill_with_its_kept_rows(cluster, workers):
    """`embedding_cache_mb`: the second request with an image (new text after it) makes no
    Encode call; the prefill worker gets the encoder's rows from the first. Another tenant's
    request with the same image is encoded again (its cache salt keys its own entries), and
    outputs behind NIXL handles are never kept."""
    enc, pre, _ = workers
    image = {"type": "image", "image": png(21)}
    for question in ("What is it?", "And its colours?"):
        await cluster.client.generate_text(chat(image, {"type": "text", "text": question}))
    assert len(enc.requests) == 1 and len(pre.requests) == 2
    first, second = (r.multimodal.embeddings for r in pre.requests)
    assert second == first  # the same rows and deepstack, from the router's copy
    async with Client(cluster.router.address, api_key=OTHER_KEY) as other:
        await other.generate_text(chat(image, {"type": "text", "text": "What is it?"}))
    assert len(enc.requests) == 2
    enc.handles = True
    for question in ("One?", "Two?"):
        fresh = {"type": "image", "image": png(22)}
        await cluster.client.generate_text(chat(fresh, {"type": "text", "text": question}))
    assert len(enc.requests) == 4
