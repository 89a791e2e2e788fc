"""Encoding overlapped with prefill end to end (`router.overlap`): router + encoder + prefill
+ decode as real processes on a tiny random checkpoint, `overlap_prefill` on.

A prompt with text, an image, more text and a video: the router encodes the image, then the
video partition by partition, and prefills the prompt up to the first piece not yet encoded
as they arrive. How many steps run depends on how far the encoder is ahead, but not what
they reuse: each step finds every block of the one before it and the request's own prefill
every block of the last one, so over a fresh prompt the prefill worker's prefix-cache hits
are its lookups minus the request's own (the steps' blocks, each found once). The tokens
equal the offline engine's (greedy, no reuse).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from common.engine import Engine
from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client
from router.pieces import pieces_of
from tests.cluster import Cluster, start_cluster

pytestmark = pytest.mark.slow

BLOCK = 8
NUM_BLOCKS = 512
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


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
def engine(ckpt: Any) -> Engine:
    return Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_batch=4)


def messages(seed: int) -> list[dict[str, Any]]:
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


def reference(engine: Engine, chat: Any) -> list[int]:
    """Greedy tokens of the offline engine, no prefix reuse."""
    p = engine.process(chat)
    seq = engine.prefill(p.prompt_token_ids, engine.encode(p), GREEDY, use_prefix_cache=False)
    while seq.finish_reason is None:
        engine.decode_step([seq])
    engine.release(seq)
    return seq.output


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
    chat = messages(1)
    first, last = first_and_last_piece(engine, chat)
    n = len(engine.process(chat).prompt_token_ids)
    before = (await asyncio.to_thread(cluster.worker, "prefill")).load
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        result = await client.generate_text(chat, GREEDY, timeout_s=120)
    # At least the text step ran (it starts with the encoding): its blocks, and the
    # request's own.
    least = before.cache_lookups + first // BLOCK + n // BLOCK
    hits, lookups = await prefill_counts(cluster, least)
    steps_blocks = lookups - before.cache_lookups - n // BLOCK
    assert hits - before.cache_hits == steps_blocks >= first // BLOCK > 0
    # The request's own prefill reused the last step's blocks: at least the text's, at
    # most everything before the last partition.
    assert first // BLOCK * BLOCK <= result.cached_tokens <= last // BLOCK * BLOCK
    assert result.token_ids == reference(engine, chat)


async def test_overlapped_requests_in_parallel_equal_the_engine(
    cluster: Cluster, engine: Engine
) -> None:
    chats = [messages(seed) for seed in (2, 3, 4)]
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        results = await asyncio.gather(
            *(client.generate_text(chat, GREEDY, timeout_s=120) for chat in chats)
        )
    for chat, result in zip(chats, results, strict=True):
        assert result.token_ids == reference(engine, chat)
