"""Overlapped prefill (`router.overlap`) when things fail, against the fake workers of
`tests.test_router`: a step whose prefill worker is gone fails over at once (its final
prefill never goes to that worker), embeddings lost with their encoder are encoded again
without overlap (read as each arrives, not after later pieces), and the partitions the
chosen worker already caches count in `epd:partitions_skipped` as without overlap."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from common.handoff import EMBEDDINGS_LOST
from common.roles import Role
from common.sampling import SamplingParams
from tests.test_router import (
    FIRST,
    FakeDecode,
    FakeEncoder,
    FakePrefill,
    chat,
    prompt_hashes,
    start_router,
)
from tests.test_router import ckpt as ckpt  # fixture


@pytest.fixture
async def cluster(ckpt):
    # Without kept outputs (`embedding_cache_mb`) every encode is an Encode call, counted.
    c = await start_router(ckpt, overlap_prefill=True, embedding_cache_mb=0)
    yield c
    await c.close()


def video_chat(seed: int, frames: int = 8) -> list[dict[str, Any]]:
    clip = np.random.default_rng(seed).integers(0, 256, (frames, 32, 32, 3), dtype=np.uint8)
    return chat(
        {"type": "text", "text": "A few words first, then the clip."},
        {"type": "video", "video": clip, "fps": 2.0},
        {"type": "text", "text": "What happens?"},
    )


class PieceEncoder(FakeEncoder):
    """`FakeEncoder` answering a piece (`partition_indices`) with its partitions' rows."""

    async def Encode(self, request, context):
        for item in request.items:
            if item.partition_indices:
                kept = [item.partitions[i] for i in item.partition_indices]
                del item.partitions[:]
                item.partitions.extend(kept)
        return await super().Encode(request, context)


def steps(prefill: FakePrefill) -> list[Any]:
    return [r for r in prefill.requests if ":step" in r.request_id]


def finals(prefill: FakePrefill) -> list[Any]:
    return [r for r in prefill.requests if ":step" not in r.request_id]


class GoneOnSteps(FakePrefill):
    """A prefill worker that cannot be reached once a request's steps begin."""

    async def Prefill(self, request, context):
        if ":step" in request.request_id:
            self.requests.append(request)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        return await super().Prefill(request, context)


class LosesEmbeddingsOnce(FakePrefill):
    """Its first own prefill finds an embedding lost with its encoder (a lease ran out)."""

    lost = False

    async def Prefill(self, request, context):
        if ":step" not in request.request_id and not self.lost:
            self.lost = True
            self.requests.append(request)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"embeddings.rows: {EMBEDDINGS_LOST} (lease gone)"
            )
        return await super().Prefill(request, context)


async def test_a_step_whose_worker_is_gone_fails_over_at_once(cluster) -> None:
    messages = video_chat(1)
    gone, healthy = GoneOnSteps(), FakePrefill()
    _, hashes = prompt_hashes(cluster, messages)
    gone.cached = hashes[:1]  # the router prefers it: it caches the prompt's first block
    for role, servicer in (
        (Role.ENCODER, PieceEncoder()),
        (Role.PREFILL, gone),
        (Role.PREFILL, healthy),
        (Role.DECODE, FakeDecode()),
    ):
        await cluster.add(role, servicer)
    await asyncio.sleep(0.3)  # the router follows both workers' KV events
    result = await cluster.client.generate_text(messages, SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]
    assert len(steps(gone)) == 1 and finals(gone) == []  # no final prefill sent there
    assert len(finals(healthy)) == 1


async def test_embeddings_lost_are_encoded_again_without_overlap(cluster) -> None:
    enc, pre = PieceEncoder(), LosesEmbeddingsOnce()
    for role, servicer in ((Role.ENCODER, enc), (Role.PREFILL, pre), (Role.DECODE, FakeDecode())):
        await cluster.add(role, servicer)
    result = await cluster.client.generate_text(video_chat(2), SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]
    first_final = pre.requests.index(finals(pre)[0])
    # After the loss: no step, one Encode call for the whole video, one prefill.
    assert [":step" in r.request_id for r in pre.requests[first_final + 1 :]] == [False]
    pieces = len(enc.requests) - 1
    assert pieces > 1 and not enc.requests[-1].items[0].partition_indices


async def test_partitions_the_worker_caches_count_as_skipped(cluster) -> None:
    short, longer = video_chat(3, frames=8), video_chat(3, frames=12)
    enc, pre = PieceEncoder(), FakePrefill()
    _, hashes = prompt_hashes(cluster, short)
    pre.cached = hashes  # the 8-frame prompt's full blocks: its leading partitions
    for role, servicer in ((Role.ENCODER, enc), (Role.PREFILL, pre), (Role.DECODE, FakeDecode())):
        await cluster.add(role, servicer)
    await asyncio.sleep(0.3)
    await cluster.client.generate_text(longer, SamplingParams(max_tokens=2))
    assert cluster.router.orchestrator.metrics.partitions_skipped._value.get() > 0
