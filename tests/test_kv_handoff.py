"""Prefill -> decode over gRPC with the KV moving by real NIXL READs (UCX, host memory).

Both workers run as in-process gRPC servers on 127.0.0.1 (their own NIXL agents), except
`test_prefill_in_another_process`, which starts `python -m prefill_worker`. Every answer is
compared token for token with the offline `Engine` on the same tiny checkpoint. The helpers
here (`Cluster`, `make_handoff`, `run_prefill`, `run_decode`) are shared by the worker tests.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from common.engine import Engine, GenerateResult
from common.handoff import handle_signature
from common.kv.allocator import blocks_for
from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.roles import PROTOCOL_VERSION
from common.sampling import SamplingParams
from common.server.role import RoleServer
from common.server.rpc import channel, start_server
from common.wire.convert import params_to_proto, sampling_to_proto
from common.wire.kv import layout_from_proto, layout_to_proto
from decode_worker.server import serve as serve_decode
from decode_worker.settings import DecodeSettings
from epd.v1 import (
    decode_service_pb2,
    decode_service_pb2_grpc,
    prefill_service_pb2,
    prefill_service_pb2_grpc,
    registry_service_pb2,
    registry_service_pb2_grpc,
)
from prefill_worker.server import serve as serve_prefill
from prefill_worker.settings import PrefillSettings
from tests.cluster import cluster_credentials, cluster_security

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = 8
NUM_BLOCKS = 256
ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------ prompts


def image(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def video(seed: int, frames: int = 8, size: int = 64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, size, size, 3), dtype=np.uint8)


def user(*parts: Any) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


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
        multimodal=params_to_proto(params.without_embeddings()),
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


async def test_same_video_new_question_pulls_only_missing_blocks(cluster: Cluster) -> None:
    c = cluster
    first_q = user(vid_part(7), "What happens first?")
    second_q = user(vid_part(7), "And what happens at the very end of it?")
    t1, p1 = make_handoff(c.engine, first_q)
    t2, p2 = make_handoff(c.engine, second_q)
    root = c.decode.servicer.runner.allocator.root
    h1 = block_hashes(t1, BLOCK, p1, root=root)
    h2 = block_hashes(t2, BLOCK, p2, root=root)
    common = next(i for i, (a, b) in enumerate(zip(h1, h2, strict=False)) if a != b)
    assert common >= 4  # the video spans several shared blocks

    reply1, answer1 = await generate(c, first_q, GREEDY)
    assert_same(answer1, c.expected(first_q, GREEDY))
    assert reply1.cached_tokens == 0
    decode_cache = set(c.decode.servicer.runner.allocator.cached_hashes())
    assert set(h1) <= decode_cache  # every pulled full block entered decode's cache
    before = c.decode.servicer.counters
    pulled0, bytes0, reused0 = before.blocks_pulled, before.bytes_pulled, before.blocks_reused

    reply2 = await run_prefill(c, t2, p2, GREEDY)
    assert reply2.cached_tokens == common * BLOCK
    assert reply2.computed_tokens == len(t2) - common * BLOCK
    assert list(reply2.kv.block_hashes) == h2
    answer2 = await run_decode(c, decode_request(t2, p2, GREEDY, reply2))
    assert_same(answer2, c.expected(second_q, GREEDY))

    lacked = [i for i, h in enumerate(h2) if h not in decode_cache]
    want_pulled = len(lacked) + (1 if len(t2) % BLOCK else 0)  # + the partial last block
    head = answer2.chunks[0]
    assert head.blocks_reused == len(h2) - len(lacked)
    assert head.blocks_pulled == want_pulled
    counters = c.decode.servicer.counters
    block_bytes = reply2.kv.layout.block_bytes
    assert counters.blocks_pulled - pulled0 == want_pulled
    assert counters.bytes_pulled - bytes0 == want_pulled * block_bytes
    assert counters.blocks_reused - reused0 == len(h2) - len(lacked)
    assert set(h2) <= set(c.decode.servicer.runner.allocator.cached_hashes())


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


@pytest.mark.slow
async def test_prefill_in_another_process(cluster: Cluster, ckpt: Path, tmp_path: Path) -> None:
    log = tmp_path / "prefill.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "prefill_worker",
            f"--model={ckpt}",
            f"--block-size={BLOCK}",
            "--num-blocks=64",
            "--port=0",
            f"--security-cluster-token-file={cluster_security().cluster_token_file}",
            cwd=ROOT,
            stdout=out,
            stderr=out,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        address = None
        deadline = time.monotonic() + 120
        while address is None:
            assert proc.returncode is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            found = re.search(r"prefill worker (\S+) serving", log.read_text())
            address = found.group(1) if found else None
            await asyncio.sleep(0.1)
        messages = user(img_part(11), vid_part(12, 4), "Which came first?")
        tokens, params = make_handoff(cluster.engine, messages)
        async with channel(address, credentials=cluster_credentials()) as ch:
            stub = prefill_service_pb2_grpc.PrefillServiceStub(ch)
            reply = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=60)
            assert reply.kv.agent_name.startswith(f"prefill-{proc.pid}-")
            answer = await run_decode(cluster, decode_request(tokens, params, GREEDY, reply))
            assert_same(answer, cluster.expected(messages, GREEDY))
            assert answer.chunks[0].blocks_pulled == blocks_for(len(tokens), BLOCK)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, log.read_text()


class FakeRegistry(registry_service_pb2_grpc.RegistryServiceServicer):
    """Records registrations and heartbeats; asks for fast heartbeats."""

    def __init__(self) -> None:
        self.workers: list[registry_service_pb2.WorkerInfo] = []
        self.loads: list[registry_service_pb2.WorkerLoad] = []

    async def Register(
        self, request: registry_service_pb2.RegisterRequest, context: Any
    ) -> registry_service_pb2.RegisterResponse:
        self.workers.append(request.worker)
        return registry_service_pb2.RegisterResponse(
            worker_id=f"w{len(self.workers)}", heartbeat_interval_ms=50
        )

    async def Heartbeat(
        self, request: registry_service_pb2.HeartbeatRequest, context: Any
    ) -> registry_service_pb2.HeartbeatResponse:
        self.loads.append(request.load)
        return registry_service_pb2.HeartbeatResponse(known=True)


async def test_workers_register_their_layout_and_heartbeat(ckpt: Path) -> None:
    fake = FakeRegistry()
    router = await start_server(
        [lambda s: registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(fake, s)]
    )
    common_kw: dict[str, Any] = {
        "model": str(ckpt),
        "block_size": BLOCK,
        "num_blocks": 32,
        "router_address": router.address,
        "security": cluster_security(),
    }
    prefill = await serve_prefill(PrefillSettings(name="p0", **common_kw))
    decode = await serve_decode(DecodeSettings(name="d0", **common_kw))
    try:
        await eventually(lambda: len(fake.workers) == 2 and len(fake.loads) >= 4)
    finally:
        await decode.stop(0)
        await prefill.stop(0)
        await router.stop(0)
    by_role = {w.role: w for w in fake.workers}
    p = by_role[registry_service_pb2.WORKER_ROLE_PREFILL]
    d = by_role[registry_service_pb2.WORKER_ROLE_DECODE]
    assert (p.address, p.name, d.address, d.name) == (prefill.address, "p0", decode.address, "d0")
    assert p.kv_layout == d.kv_layout == layout_to_proto(prefill.servicer.runner.kv_layout)
    assert p.model == d.model == p.kv_layout.model
    assert p.protocol_version == d.protocol_version == PROTOCOL_VERSION
    assert "nixl" in p.capabilities
    assert all(load.kv_blocks_free + load.kv_blocks_used == 32 for load in fake.loads)


@pytest.mark.parametrize("length", [5, 2 * BLOCK, 2 * BLOCK + 1, 3 * BLOCK - 1])
async def test_raw_prompts_around_block_edges(cluster: Cluster, length: int) -> None:
    """Shorter than a block (no hash, one partial block), exactly full blocks (no partial
    block), and one token either side."""
    c = cluster
    tokens = [(37 * i + length) % 900 + 50 for i in range(length)]
    params = MultimodalParams()
    sampling = SamplingParams(max_tokens=9, ignore_eos=True)
    e = c.engine
    fresh = Engine(e.config, e.runner.model, e.vision, e.processor, block_size=BLOCK, num_blocks=64)
    seq = fresh.prefill(tokens, params, sampling)
    while seq.finish_reason is None:
        fresh.decode_step([seq])
    reply = await run_prefill(c, tokens, params, sampling)
    assert len(reply.kv.block_hashes) == length // BLOCK
    assert len(reply.kv.blocks) == blocks_for(length, BLOCK)
    answer = await run_decode(c, decode_request(tokens, params, sampling, reply))
    assert answer.token_ids == seq.output
    head = answer.chunks[0]
    assert head.blocks_pulled + head.blocks_reused == blocks_for(length, BLOCK)
