"""Partial video reuse end to end (docs/block-hash.md, "Partition keys"): router + encoder +
prefill + decode as real processes on a tiny random checkpoint.

A video V and V with frames appended: prefill reuses every block of V's frames, decode
already holds them and pulls only the rest, the router asks the encoder for the new
temporal patches alone (and the prefill worker takes the video as its pieces), and the
tokens equal the offline engine's (greedy, no reuse). A video differing in
one frame reuses exactly the blocks before that frame's run. (Where partition keys are not
allowed, tests/test_partition_keys.py shows the keys fall back to the item's.)

A second deployment, without overlap, shows the plain path: the warm request's one
`Encode` call holds only the new temporal patches.

The first deployment runs with `overlap_prefill` on (`router.overlap`): the router encodes a
video partition by partition and the prefill worker computes the prompt up to the first
partition not yet encoded as they arrive, so even a first request finds the text before the
video cached (and, as far as the encoder was ahead, the partitions after it), and its tokens
still equal the engine's (the last section counts the steps).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from common.engine import Engine
from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from common.wire.kv import layout_from_proto
from epd.client import Client
from router.pieces import pieces_of
from tests.cluster import Cluster, start_cluster

pytestmark = pytest.mark.slow

BLOCK = 8
NUM_BLOCKS = 512
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    c = start_cluster(
        ckpt,
        tmp_path_factory.mktemp("logs"),
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        router_args=("--overlap-prefill", "true"),
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def plain(ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A deployment without overlap: one Encode call per request."""
    c = start_cluster(
        ckpt, tmp_path_factory.mktemp("plain"), block_size=BLOCK, num_blocks=NUM_BLOCKS
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def engine(ckpt: Any) -> Engine:
    return Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_batch=4)


def clip(seed: int, frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, 64, 64, 3), dtype=np.uint8)


def ask(video: np.ndarray) -> list[dict[str, Any]]:
    part = {"type": "video", "video": video, "fps": 2.0}
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Clip:"},
                part,
                {"type": "text", "text": "What moves?"},
            ],
        }
    ]


def reference(engine: Engine, messages: Any) -> list[int]:
    """Greedy tokens of the offline engine, no prefix reuse."""
    p = engine.process(messages)
    seq = engine.prefill(p.prompt_token_ids, engine.encode(p), GREEDY, use_prefix_cache=False)
    while seq.finish_reason is None:
        engine.decode_step([seq])
    engine.release(seq)
    return seq.output


def stepped_tokens(engine: Engine, messages: Any) -> int:
    """The most tokens the request's own prefill reuses after the overlapped steps: the
    full blocks before the last partition's first placeholder (a last step's)."""
    (item,) = engine.process(messages).params.items
    return item.runs[-1][0] // BLOCK * BLOCK


def shared_blocks(engine: Engine, cluster: Cluster, a: Any, b: Any) -> tuple[int, int]:
    """(leading blocks whose hashes agree, prompt tokens of `b`) under the cluster's root."""
    root = layout_root(layout_from_proto(cluster.worker("decode").info.kv_layout))
    pa, pb = engine.process(a), engine.process(b)
    ha = block_hashes(pa.prompt_token_ids, BLOCK, pa.params, root=root)
    hb = block_hashes(pb.prompt_token_ids, BLOCK, pb.params, root=root)
    shared = next((i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), len(ha))
    return shared, len(pb.prompt_token_ids)


async def encoder_counts_settled(cluster: Cluster) -> tuple[int, int]:
    """(hits, lookups) of the encoder cache once two heartbeats agree."""
    last = None
    for _ in range(150):
        load = (await asyncio.to_thread(cluster.worker, "encoder")).load
        now = (load.cache_hits, load.cache_lookups)
        if now == last:
            return now
        last = now
        await asyncio.sleep(0.3)
    raise AssertionError("encoder counts never settled")


async def encoder_counts(cluster: Cluster, lookups: int) -> tuple[int, int]:
    """(hits, lookups) of the encoder cache once the heartbeat shows `lookups` lookups."""
    for _ in range(150):
        load = (await asyncio.to_thread(cluster.worker, "encoder")).load
        if load.cache_lookups >= lookups:
            return load.cache_hits, load.cache_lookups
        await asyncio.sleep(0.1)
    raise AssertionError(f"encoder lookups never reached {lookups}")


async def test_appended_frames_reuse_every_shared_block_and_encode_only_new_frames(
    cluster: Cluster, engine: Engine
) -> None:
    frames = clip(31, 12)
    first, second = ask(frames[:8]), ask(frames)  # 4 temporal patches, then 6
    v = engine.process(first)
    shared, n2 = shared_blocks(engine, cluster, first, second)
    assert shared * BLOCK >= v.params.items[0].end  # every block of V's frames is shared
    before = (await asyncio.to_thread(cluster.worker, "encoder")).load
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        a = await client.generate_text(first, GREEDY, timeout_s=120)
        hits, lookups = await encoder_counts(cluster, before.cache_lookups + 4)
        assert (hits, lookups) == (before.cache_hits, before.cache_lookups + 4)
        b = await client.generate_text(second, GREEDY, timeout_s=120)
    # The text before the video (and maybe partitions) was prefilled while it was encoded.
    text = v.params.items[0].position // BLOCK * BLOCK
    assert 0 < text <= a.cached_tokens <= stepped_tokens(engine, first)
    # Prefill reuses V's blocks (and any steps' past them), decode holds V's and pulls
    # only the rest.
    assert shared * BLOCK <= b.cached_tokens <= max(stepped_tokens(engine, second), shared * BLOCK)
    assert b.blocks_reused == shared
    assert b.blocks_pulled == -(-n2 // BLOCK) - shared
    # The router asked the encoder for the 2 new temporal patches alone (V's 4 lie inside
    # the prefill worker's cached prefix: neither encoded nor sent), and it encoded them.
    assert await encoder_counts(cluster, lookups + 2) == (hits, lookups + 2)
    assert a.token_ids == reference(engine, first)
    assert b.token_ids == reference(engine, second)


async def test_without_overlap_the_warm_request_encodes_and_sends_only_new_partitions(
    plain: Cluster, engine: Engine
) -> None:
    frames = clip(33, 12)
    first, second = ask(frames[:8]), ask(frames)  # 4 temporal patches, then 6
    shared, _ = shared_blocks(engine, plain, first, second)
    hits, lookups = await encoder_counts_settled(plain)
    async with Client(plain.address, api_key=plain.client_key) as client:
        a = await client.generate_text(first, GREEDY, timeout_s=120)
        assert await encoder_counts(plain, lookups + 4) == (hits, lookups + 4)
        b = await client.generate_text(second, GREEDY, timeout_s=120)
    assert a.cached_tokens == 0
    assert b.cached_tokens >= shared * BLOCK and b.blocks_reused == shared
    # V's 4 temporal patches were neither encoded nor looked up again: the 2 new ones alone.
    assert await encoder_counts(plain, lookups + 6) == (hits, lookups + 6)
    assert a.token_ids == reference(engine, first)
    assert b.token_ids == reference(engine, second)


async def test_video_differing_in_one_frame_reuses_exactly_the_blocks_before_it(
    cluster: Cluster, engine: Engine
) -> None:
    frames = clip(41, 8)
    changed = frames.copy()
    changed[5] = clip(42, 1)[0]  # frame 5: temporal patch 2
    first, second = ask(frames), ask(changed)
    run_start = engine.process(first).params.items[0].runs[2][0]
    shared, _ = shared_blocks(engine, cluster, first, second)
    assert shared == run_start // BLOCK
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        await client.generate_text(first, GREEDY, timeout_s=120)
        b = await client.generate_text(second, GREEDY, timeout_s=120)
    assert shared * BLOCK <= b.cached_tokens <= max(stepped_tokens(engine, second), shared * BLOCK)
    assert b.blocks_reused == shared
    assert b.token_ids == reference(engine, second)


async def test_text_and_partitions_before_the_last_are_prefilled_while_it_is_encoded(
    cluster: Cluster, engine: Engine
) -> None:
    document = "Here is a long report to read before the clip. " * 12
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": document},
                {"type": "video", "video": clip(51, 8), "fps": 2.0},
                {"type": "text", "text": "Summarise both."},
            ],
        }
    ]
    first_item = engine.process(messages).params.items[0].position
    assert first_item > 8 * BLOCK
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        result = await client.generate_text(messages, GREEDY, timeout_s=120)
    assert first_item // BLOCK * BLOCK <= result.cached_tokens <= stepped_tokens(engine, messages)
    assert result.token_ids == reference(engine, messages)


# ---------------------------------------------- overlapped steps over a mixed prompt
#
# A prompt with text, an image, more text and a video: the router encodes the image, then
# the video partition by partition, and prefills the prompt up to the first piece not yet
# encoded as they arrive. How many steps run depends on how far the encoder is ahead, but
# not what they reuse: each step finds every block of the one before it and the request's
# own prefill every block of the last one, so over a fresh prompt the prefill worker's
# prefix-cache hits are its lookups minus the request's own (the steps' blocks, each found
# once).


def mixed(seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    clip = rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    content = [
        {"type": "text", "text": f"Report {seed}: the quick brown fox jumps. " * 6},
        {"type": "image", "image": image},
        {"type": "text", "text": "and then, a little later, this clip:"},
        {"type": "video", "video": clip, "fps": 2.0},
        {"type": "text", "text": "What changed between them?"},
    ]
    return [{"role": "user", "content": content}]


def first_and_last_piece(engine: Engine, chat: Any) -> tuple[int, int]:
    """Prompt index of the first placeholder of the first piece and of the last."""
    p = engine.process(chat)
    pieces = pieces_of(p.params.items, range(len(p.params.items)))
    assert len(pieces) == 5  # the image, then the video's 4 temporal patches
    return pieces[0].start, pieces[-1].start


async def prefill_counts(cluster: Cluster, lookups: int) -> tuple[int, int]:
    """(hits, lookups) of the prefill worker's prefix cache once its heartbeat shows at
    least `lookups` lookups and two more heartbeats show no change."""
    last = None
    for _ in range(300):
        load = (await asyncio.to_thread(cluster.worker, "prefill")).load
        now = (load.cache_hits, load.cache_lookups)
        if now[1] >= lookups and now == last:
            return now
        last = now if now[1] >= lookups else None
        await asyncio.sleep(0.5)
    raise AssertionError(f"prefill lookups never settled at {lookups} or more")


async def test_each_step_reuses_the_one_before_and_prefill_the_last(
    cluster: Cluster, engine: Engine
) -> None:
    chat = mixed(1)
    first, last = first_and_last_piece(engine, chat)
    n = len(engine.process(chat).prompt_token_ids)
    # The counts once the earlier tests' requests have all reached the heartbeat.
    hits0, lookups0 = await prefill_counts(cluster, 0)
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        result = await client.generate_text(chat, GREEDY, timeout_s=120)
    # At least the text step ran (it starts with the encoding): its blocks, and the
    # request's own.
    least = lookups0 + first // BLOCK + n // BLOCK
    hits, lookups = await prefill_counts(cluster, least)
    steps_blocks = lookups - lookups0 - n // BLOCK
    assert hits - hits0 == steps_blocks >= first // BLOCK > 0
    # The request's own prefill reused the last step's blocks: at least the text's, at
    # most everything before the last partition.
    assert first // BLOCK * BLOCK <= result.cached_tokens <= last // BLOCK * BLOCK
    assert result.token_ids == reference(engine, chat)


async def test_overlapped_requests_in_parallel_equal_the_engine(
    cluster: Cluster, engine: Engine
) -> None:
    chats = [mixed(seed) for seed in (2, 3, 4)]
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        results = await asyncio.gather(
            *(client.generate_text(chat, GREEDY, timeout_s=120) for chat in chats)
        )
    for chat, result in zip(chats, results, strict=True):
        assert result.token_ids == reference(engine, chat)
