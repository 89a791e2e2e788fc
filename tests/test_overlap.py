"""Encoding overlapped with prefill end to end (`router.overlap`): router + encoder + prefill
+ decode as real processes on a tiny random checkpoint, `overlap_prefill` on.

A prompt with text, an image, more text and a video: the router encodes the image, then the
video partition by partition, and after each piece prefills the prompt up to the next
piece's first placeholder. Each step reuses the blocks of the one before it, the request's
own prefill reuses the last step's, and the tokens equal the offline engine's (greedy, no
reuse). The counts come from the prefill worker's prefix-cache lookups and hits.
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


def expected_steps(engine: Engine, chat: Any) -> tuple[list[tuple[int, int]], int]:
    """(prompt blocks, reused blocks) of each step a fresh prompt gets, and the blocks its
    own prefill reuses: step k covers the tokens before piece k's first placeholder and
    runs when that adds a full block."""
    p = engine.process(chat)
    pieces = pieces_of(p.params.items, range(len(p.params.items)))
    assert len(pieces) == 5  # the image, then the video's 4 temporal patches
    steps, cached = [], 0
    for piece in pieces:
        if piece.start // BLOCK > cached:
            steps.append((piece.start // BLOCK, cached))
            cached = piece.start // BLOCK
    return steps, cached


async def prefill_counts(cluster: Cluster, lookups: int) -> tuple[int, int]:
    """(hits, lookups) of the prefill worker's prefix cache once its heartbeat shows at
    least `lookups` lookups."""
    for _ in range(200):
        load = (await asyncio.to_thread(cluster.worker, "prefill")).load
        if load.cache_lookups >= lookups:
            return load.cache_hits, load.cache_lookups
        await asyncio.sleep(0.1)
    raise AssertionError(f"prefill lookups never reached {lookups}")


async def test_each_piece_is_prefilled_as_it_arrives_and_reused_by_the_next(
    cluster: Cluster, engine: Engine
) -> None:
    chat = messages(1)
    steps, cached = expected_steps(engine, chat)
    n = len(engine.process(chat).prompt_token_ids)
    assert len(steps) >= 3  # the text, then pieces as they arrive
    before = (await asyncio.to_thread(cluster.worker, "prefill")).load
    async with Client(cluster.address, api_key=cluster.client_key) as client:
        result = await client.generate_text(chat, GREEDY, timeout_s=120)
    # Every step looked up its whole prompt and found the blocks of the step before it;
    # the request's own prefill found every block of the last step.
    lookups = before.cache_lookups + sum(blocks for blocks, _ in steps) + n // BLOCK
    hits = before.cache_hits + sum(reused for _, reused in steps) + cached
    assert await prefill_counts(cluster, lookups) == (hits, lookups)
    assert result.cached_tokens == cached * BLOCK
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
