"""Prefill -> decode over gRPC with the KV moving by real NIXL READs (UCX, host memory).

Both workers run as in-process gRPC servers on 127.0.0.1 (their own NIXL agents). Text and
image+video prompts, and four requests in flight on one decode worker, answer token for
token as the offline `Engine` on the same tiny checkpoint, with the handle's blocks and
hashes those of the prompt and the lease released after the pull. Block reuse and block
edges are in tests/test_handoff_blocks.py, a prefill worker in its own process and router
registration in tests/test_handoff_deployment.py. The helpers here (`Cluster`,
`make_handoff`, `run_prefill`, `run_decode`) are shared by the worker tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from common.engine import Engine, GenerateResult
from common.handoff import handle_signature
from common.kv.allocator import blocks_for
from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams
from common.server.role import RoleServer
from common.server.rpc import channel
from common.wire.convert import params_to_proto
from common.wire.kv import layout_from_proto
from common.wire.sampling import sampling_to_proto
from decode_worker.server import serve as serve_decode
from decode_worker.settings import DecodeSettings
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
)
from prefill_worker.server import serve as serve_prefill
from prefill_worker.settings import PrefillSettings
from tests.cluster import cluster_credentials, cluster_security
from tests.model_fixtures import image, user, video

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = 8
NUM_BLOCKS = 256

# ------------------------------------------------------------------------------ prompts


def img_part(seed: int) -> dict[str, Any]:
    return {"type": "image", "image": image(seed)}


def vid_part(seed: int, frames: int = 8) -> dict[str, Any]:
    return {"type": "video", "video": video(seed, frames), "fps": 2.0}


TEXT = user("Describe the weather in the city today.")
IMAGE_VIDEO = user(img_part(1), "and then", vid_part(2), "What happens?")
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)

# ------------------------------------------------------------------------------ cluster


@dataclass
class Cluster:
    """A tiny engine for expected results plus one prefill and one decode worker."""

    engine: Engine
    prefill: RoleServer[Any]
    decode: RoleServer[Any]
    prefill_stub: Any
    decode_stub: Any
    channels: list[Any]

    def expected(self, messages: Any, sampling: SamplingParams) -> GenerateResult:
        """The offline engine's answer, from a fresh cache sharing the loaded weights."""
        e = self.engine
        fresh = Engine(
            e.config, e.runner.model, e.vision, e.processor, block_size=BLOCK, num_blocks=512
        )
        return fresh.generate(messages, sampling)


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return default_checkpoint("tiny")


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Engine:
    return Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=512)


async def start_cluster(ckpt: Path, engine: Engine, **prefill_kw: Any) -> Cluster:
    prefill = await serve_prefill(
        PrefillSettings(
            model=str(ckpt),
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            security=cluster_security(),
            **prefill_kw,
        )
    )
    decode = await serve_decode(
        DecodeSettings(
            model=str(ckpt),
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            max_batch=8,
            security=cluster_security(),
        )
    )
    creds = cluster_credentials()
    channels = [channel(a, credentials=creds) for a in (prefill.address, decode.address)]
    return Cluster(
        engine,
        prefill,
        decode,
        prefill_service_pb2_grpc.PrefillServiceStub(channels[0]),
        decode_service_pb2_grpc.DecodeServiceStub(channels[1]),
        channels,
    )


async def stop_cluster(c: Cluster) -> None:
    for ch in c.channels:
        await ch.close()
    await c.decode.stop(0)
    await c.prefill.stop(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(ckpt: Path, engine: Engine) -> AsyncIterator[Cluster]:
    c = await start_cluster(ckpt, engine)
    yield c
    await stop_cluster(c)


# ----------------------------------------------------------------------------- helpers


def make_handoff(engine: Engine, messages: Any, **side: Any) -> tuple[list[int], MultimodalParams]:
    """Prompt ids and encoded params, as the router would send them."""
    processed = engine.process(messages, **side)
    return processed.prompt_token_ids, engine.encode(processed)


def prefill_request(
    tokens: Sequence[int], params: MultimodalParams, sampling: SamplingParams, rid: str = "r"
) -> prefill_service_pb2.PrefillRequest:
    return prefill_service_pb2.PrefillRequest(
        request_id=rid,
        prompt_token_ids=list(tokens),
        multimodal=params_to_proto(params),
        sampling=sampling_to_proto(sampling),
    )


def decode_request(
    tokens: Sequence[int],
    params: MultimodalParams,
    sampling: SamplingParams,
    reply: prefill_service_pb2.PrefillResponse,
    rid: str = "r",
) -> decode_service_pb2.DecodeRequest:
    return decode_service_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=list(tokens),
        multimodal=params_to_proto(MultimodalParams(params.items, {}, params.mrope_position_delta)),
        sampling=sampling_to_proto(sampling),
        first_token_id=reply.first_token_id,
        kv=reply.kv,
    )


def resign(request: decode_service_pb2.DecodeRequest) -> decode_service_pb2.DecodeRequest:
    """Sign `request.kv` again with the test deployment's key (after a test changed it), as a
    worker holding the cluster key could: what decode checks after the signature."""
    key = cluster_security().cluster_key()
    assert key is not None
    request.kv.signature = handle_signature(request.kv, key)
    return request


async def run_prefill(
    c: Cluster, tokens: Sequence[int], params: MultimodalParams, sampling: SamplingParams
) -> prefill_service_pb2.PrefillResponse:
    return await c.prefill_stub.Prefill(prefill_request(tokens, params, sampling), timeout=60)


@dataclass
class Answer:
    token_ids: list[int]
    text: str
    chunks: list[decode_service_pb2.DecodeResponse]


async def run_decode(c: Cluster, request: decode_service_pb2.DecodeRequest) -> Answer:
    """The whole answer: the prefill's first token (the caller's) + what decode streams."""
    chunks = [chunk async for chunk in c.decode_stub.Decode(request, timeout=60)]
    tokens = [request.first_token_id, *(t for ch in chunks for t in ch.token_ids)]
    return Answer(tokens, c.engine.processor.decode(tokens), chunks)


async def generate(
    c: Cluster, messages: Any, sampling: SamplingParams, **side: Any
) -> tuple[prefill_service_pb2.PrefillResponse, Answer]:
    tokens, params = make_handoff(c.engine, messages, **side)
    reply = await run_prefill(c, tokens, params, sampling)
    return reply, await run_decode(c, decode_request(tokens, params, sampling, reply))


async def eventually(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def assert_same(answer: Answer, want: GenerateResult) -> None:
    assert answer.token_ids == want.token_ids
    assert answer.text == want.text
    finish = {"stop": decode_service_pb2.FINISH_REASON_STOP}
    assert answer.chunks[-1].finish_reason == finish.get(
        want.finish_reason, decode_service_pb2.FINISH_REASON_LENGTH
    )


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", ["text", "image_video"])
async def test_prefill_then_decode_equals_engine(cluster: Cluster, name: str) -> None:
    messages = {"text": TEXT, "image_video": IMAGE_VIDEO}[name]
    reply, answer = await generate(cluster, messages, GREEDY)
    assert_same(answer, cluster.expected(messages, GREEDY))
    tokens, params = make_handoff(cluster.engine, messages)
    n = len(tokens)
    assert reply.kv.num_tokens == n
    assert len(reply.kv.blocks) == blocks_for(n, BLOCK)
    root = layout_root(layout_from_proto(reply.kv.layout))
    assert list(reply.kv.block_hashes) == block_hashes(tokens, BLOCK, params, root=root)
    first = answer.chunks[0]
    # The stream follows the first token without repeating it (else `assert_same` fails).
    assert answer.token_ids[0] == reply.first_token_id
    assert first.blocks_pulled + first.blocks_reused == blocks_for(n, BLOCK)
    # The decode worker released the lease after its pull.
    await eventually(lambda: len(cluster.prefill.servicer.leases) == 0)


async def test_four_requests_in_flight_on_one_decode_worker(cluster: Cluster) -> None:
    c = cluster
    cases = [
        (TEXT, SamplingParams(max_tokens=16, ignore_eos=True)),
        (user(img_part(3), "Say something."), SamplingParams(max_tokens=14, ignore_eos=True)),
        (
            user("Look:", vid_part(4, 4), "Now?"),
            SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True),
        ),
        (
            user("one two three four five six seven eight nine ten"),
            SamplingParams(max_tokens=15, temperature=1.0, top_k=20, seed=9, ignore_eos=True),
        ),
    ]
    handoffs = [make_handoff(c.engine, m) for m, _ in cases]
    replies = [
        await run_prefill(c, t, p, s) for (t, p), (_, s) in zip(handoffs, cases, strict=True)
    ]
    steps0 = c.decode.servicer.batcher.steps
    answers = await asyncio.gather(
        *(
            run_decode(c, decode_request(t, p, s, r, rid=f"r{i}"))
            for i, ((t, p), (_, s), r) in enumerate(zip(handoffs, cases, replies, strict=True))
        )
    )
    for answer, (messages, sampling) in zip(answers, cases, strict=True):
        assert_same(answer, c.expected(messages, sampling))
    batcher = c.decode.servicer.batcher
    assert batcher.max_batch_seen >= 2
    assert batcher.steps - steps0 < sum(s.max_tokens for _, s in cases)  # steps were shared
    await eventually(lambda: c.decode.servicer.runner.allocator.pool.num_used_blocks == 0)
