"""End to end: router + encoder + prefill + decode as real processes (NIXL over UCX between
them), on a tiny random checkpoint, against the offline `Engine` in this process.

One deployment serves the whole module (starting four processes takes a while), so tests
use content of their own where cache state matters.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from common.engine import Engine
from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from common.models.tiny import make_tiny_checkpoint
from common.processing.video_file import decode_video
from common.sampling import SamplingParams
from common.server.auth import service_credentials
from common.server.rpc import channel
from common.wire.kv import layout_from_proto
from epd.client import Client, GenerateError, build_request
from epd.v1 import registry_service_pb2, registry_service_pb2_grpc
from tests.cluster import Cluster, start_cluster
from tests.model_fixtures import image, user, video
from tests.test_video_file import make_video

pytestmark = pytest.mark.slow

BLOCK = 8
NUM_BLOCKS = 512
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    # Video outputs (>2 KiB) travel as NIXL handles from the encoder, image ones inline.
    c = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        encoder_args=("--inline-limit-bytes", "2048"),
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_batch=8)


def vid(seed: int, frames: int = 8) -> dict[str, Any]:
    return {"type": "video", "video": video(seed, frames), "fps": 2.0}


def img(seed: int, w: int = 64, h: int = 48) -> dict[str, Any]:
    return {"type": "image", "image": image(seed, w, h)}


def reference(
    engine: Engine, messages: Any, sampling: SamplingParams, images: Any = ()
) -> list[int]:
    """Greedy tokens of the offline engine, one request at a time, no prefix reuse."""
    p = engine.process(messages, images=images)
    seq = engine.prefill(p.prompt_token_ids, engine.encode(p), sampling, use_prefix_cache=False)
    while seq.finish_reason is None:
        engine.decode_step([seq])
    engine.release(seq)
    return seq.output


async def wait_for(predicate: Any, cluster: Cluster, timeout_s: float = 15.0) -> Any:
    """Poll Status until `predicate(status)` holds; the last status."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status = await asyncio.to_thread(cluster.status)
        if predicate(status):
            return status
        if asyncio.get_running_loop().time() > deadline:
            loads = [
                (w.info.name, w.load.active_requests, w.load.kv_blocks_used) for w in status.workers
            ]
            raise AssertionError(f"condition not reached; (name, active, kv used): {loads}")
        await asyncio.sleep(0.1)


def kv_idle(status: Any) -> bool:
    kv_roles = (registry_service_pb2.WORKER_ROLE_PREFILL, registry_service_pb2.WORKER_ROLE_DECODE)
    kv = [w for w in status.workers if w.info.role in kv_roles]
    return len(kv) == 2 and all(
        w.load.kv_blocks_free == NUM_BLOCKS and w.load.active_requests == 0 for w in kv
    )


async def test_outputs_equal_the_offline_engine_with_four_in_flight(cluster, engine):
    # Mixed: the video first, then the images in the reverse of their payload order (the
    # engine gets side payloads by index; the wire carries them inline in prompt order).
    side = [image(5, 64, 64), image(6, 96, 32)]
    mixed_engine = user(
        vid(4, 6),
        "then",
        {"type": "image", "index": 1},
        "and",
        {"type": "image", "index": 0},
        "Explain.",
    )
    mixed_wire = user(
        vid(4, 6),
        "then",
        {"type": "image", "image": side[1]},
        "and",
        {"type": "image", "image": side[0]},
        "Explain.",
    )
    cases = {
        "text": (
            user("Describe the weather in the city today."),
            user("Describe the weather in the city today."),
            (),
        ),
        "image": (user(img(1), "What is in this image?"),) * 2 + ((),),
        "video": (user("Watch:", vid(3), "What happens?"),) * 2 + ((),),
        "mixed": (mixed_wire, mixed_engine, side),
    }
    want = {name: reference(engine, e, GREEDY, s) for name, (_, e, s) in cases.items()}
    assert len(engine.process(cases["video"][1]).params.items[0].runs) >= 4  # multi-run
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        results = await asyncio.gather(
            *(client.generate_text(w, GREEDY, timeout_s=120) for w, _, _ in cases.values())
        )
    for name, result in zip(cases, results, strict=True):
        assert result.token_ids == want[name], name
        assert result.text == engine.processor.decode(want[name]), name
        assert result.finish_reason == "length"
        _, messages, images = cases[name]
        prompt = engine.process(messages, images=images).prompt_token_ids
        assert result.prompt_tokens == len(prompt), name


async def test_a_video_file_equals_the_offline_engine_given_its_decoded_frames(cluster, engine):
    data = make_video("mp4", "libx264", frames=24, rate=8)  # 3 s: 6 frames at 2 fps
    frames = decode_video(data, fps=2.0, max_frames=768)
    want = reference(engine, user("Film:", {"type": "video", "video": frames}, "Why?"), GREEDY)
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        wire = user("Film:", {"type": "video", "video": data, "fps": 2.0}, "Why?")
        result = await client.generate_text(wire, GREEDY, timeout_s=120)
    assert result.token_ids == want


async def test_same_video_new_question_reuses_prefill_cache_and_pulls_only_missing(cluster, engine):
    first = user("Cache test:", vid(21), "What happens first?")
    second = user("Cache test:", vid(21), "And what is the last thing that moves?")
    layout = cluster.worker("decode").info.kv_layout
    root = layout_root(layout_from_proto(layout))

    def hashes(messages: Any) -> tuple[int, list[bytes]]:
        p = engine.process(messages)
        ids = p.prompt_token_ids
        return len(ids), block_hashes(ids, BLOCK, p.params, root=root)

    n1, h1 = hashes(first)
    n2, h2 = hashes(second)
    shared = next(i for i, (a, b) in enumerate(zip(h1, h2, strict=False)) if a != b)
    assert shared >= 4  # the video spans several blocks
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        a = await client.generate_text(first, GREEDY, timeout_s=120)
        b = await client.generate_text(second, GREEDY, timeout_s=120)
    assert a.cached_tokens == 0
    assert (a.blocks_reused, a.blocks_pulled) == (0, -(-n1 // BLOCK))
    # Prefill reuses the shared full blocks (the last prompt token is always computed).
    assert b.cached_tokens == min(shared, (n2 - 1) // BLOCK) * BLOCK
    # Decode already holds exactly the shared blocks (pulled for the first request) and
    # pulls every other block of the prompt, the partial last one included.
    assert b.blocks_reused == shared
    assert b.blocks_pulled == -(-n2 // BLOCK) - shared
    assert b.token_ids == reference(engine, second, GREEDY)

    # A heartbeat sent between the two requests also looks idle: wait for one that counts
    # the second request's hits (the load is only as fresh as the last heartbeat).
    def hits(status: Any) -> int:
        return next(w.load.cache_hits for w in status.workers if w.info.name == "prefill")

    await wait_for(lambda s: kv_idle(s) and hits(s) >= shared, cluster)


async def test_malformed_media_is_invalid_argument_and_workers_keep_serving(cluster, engine):
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        with pytest.raises(GenerateError) as err:
            await client.generate_text(user("Look:", {"type": "image", "image": b"\x89PNG junk"}))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].content[1].image.data" in err.value.details
        request = build_request(user(vid(7, 4), "?"), GREEDY)
        request.messages[0].content[0].video.fps = 0.0
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in client._router.Generate(request):
                pass
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages[0].content[0].video.fps" in raw.value.details()
        messages = user(img(8), "Still there?")
        result = await client.generate_text(messages, GREEDY, timeout_s=120)
    assert result.token_ids == reference(engine, messages, GREEDY)


@pytest.mark.parametrize("after_chunks", [1, 4])
async def test_cancelled_stream_frees_blocks_on_prefill_and_decode(cluster, after_chunks):
    await wait_for(kv_idle, cluster)
    long = SamplingParams(max_tokens=1500, ignore_eos=True)
    messages = user(f"Cancel test {after_chunks}:", vid(30 + after_chunks), "Tell me more.")
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        stream = client.generate(messages, long, timeout_s=120)
        for _ in range(after_chunks):
            await anext(stream)
        if after_chunks > 1:  # mid-stream: the decode worker holds the request's blocks
            await wait_for(lambda s: any(w.load.kv_blocks_used > 0 for w in s.workers), cluster)
        await stream.aclose()
    await wait_for(kv_idle, cluster)


async def test_worker_with_a_mismatched_layout_is_refused(cluster):
    decode = cluster.worker("decode").info
    bad = registry_service_pb2.WorkerInfo()
    bad.CopyFrom(decode)
    bad.address = "127.0.0.1:1"
    bad.kv_layout.block_size = BLOCK * 2
    bad.kv_layout.block_bytes *= 2
    other_model = registry_service_pb2.WorkerInfo()
    other_model.CopyFrom(decode)
    other_model.address = "127.0.0.1:2"
    other_model.model = other_model.kv_layout.model = "qwen3-vl/someone-else"
    creds = service_credentials(cluster.security)  # a service of the deployment may register
    async with channel(cluster.address, credentials=creds) as ch:
        stub = registry_service_pb2_grpc.RegistryServiceStub(ch)
        for info, message in ((bad, f"block_size={BLOCK * 2}"), (other_model, "someone-else")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Register(registry_service_pb2.RegisterRequest(worker=info))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert message in err.value.details()
    addresses = {w.info.address for w in cluster.status().workers}
    assert not addresses & {"127.0.0.1:1", "127.0.0.1:2"}
