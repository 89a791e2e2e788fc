"""The router's partition skip against fake workers (`tests.test_router`'s, in process): of a
video whose leading partitions lie in the prefill worker's cached prefix, only the
partitions past it are encoded (their patch rows alone) and sent, naming their span; when
the worker evicted them meanwhile (FAILED_PRECONDITION), the router encodes the video whole
and prefills again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np

from common.roles import Role
from common.sampling import SamplingParams
from epd.v1 import encoder_service_pb2, tensor_pb2
from tests.test_router import (
    FIRST,
    Cluster,
    FakeDecode,
    FakeEncoder,
    FakePrefill,
    chat,
    ckpt,
    cluster,
    prompt_hashes,
)

__all__ = ["ckpt", "cluster"]  # fixtures of tests.test_router

BLOCK = 16  # the fake workers' block size


class PartitionEncoder(FakeEncoder):
    """Answers rows for the partitions asked for (`partition_indices`), or the whole item."""

    async def Encode(self, request, context):
        self.requests.append(request)
        out = encoder_service_pb2.EncodeResponse()
        for item in request.items:
            chosen = [item.partitions[p] for p in item.partition_indices] or item.partitions
            rows = sum(p.output_rows for p in chosen)
            refs = [
                tensor_pb2.TensorRef(
                    dtype=tensor_pb2.ELEMENT_TYPE_FLOAT32,
                    shape=[rows, 64],
                    inline_data=bytes(rows * 64 * 4),
                )
                for _ in range(3)
            ]
            out.items.add(content_hash=item.content_hash, rows=refs[0], deepstack=refs[1:])
        return out


class EvictedPrefill(FakePrefill):
    """Refuses partition rows (FAILED_PRECONDITION), as a worker that evicted the others.
    (A worker from before partition spans refused them INVALID_ARGUMENT, and the router
    encoded whole items for it: the router refuses such workers at registration now.)"""

    async def Prefill(self, request, context):
        if any(e.HasField("partition_start") for e in request.multimodal.embeddings):
            self.requests.append(request)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "carries no embeddings")
        return await super().Prefill(request, context)


def video_chat() -> list[dict[str, Any]]:
    frames = np.random.default_rng(8).integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    return chat(
        {"type": "text", "text": "Watch:"},
        {"type": "video", "video": frames, "fps": 2.0},
        {"type": "text", "text": "What moved?"},
    )


async def start(cluster: Cluster, prefill: FakePrefill) -> tuple[Any, int, PartitionEncoder]:
    """Workers added, `prefill` caching the video's first two partitions' blocks; the
    prompt, the first partition past those blocks and the encoder."""
    messages = video_chat()
    prompt, hashes = prompt_hashes(cluster, messages)
    (video,) = prompt.params.items
    start, length = video.runs[1]
    blocks = -(-(start + length) // BLOCK)  # through partition 1's last placeholder
    prefill.cached = hashes[:blocks]
    first = next(j for j, (s, n) in enumerate(video.runs) if s + n > blocks * BLOCK)
    assert 2 <= first < len(video.runs)
    enc = PartitionEncoder()
    for role, servicer in (
        (Role.ENCODER, enc),
        (Role.PREFILL, prefill),
        (Role.DECODE, FakeDecode()),
    ):
        await cluster.add(role, servicer)
    await asyncio.sleep(0.3)  # the router follows the worker's KV events
    return prompt, first, enc


async def test_only_partitions_past_the_cached_prefix_are_encoded_and_sent(
    cluster: Cluster,
) -> None:
    pre = FakePrefill()
    prompt, first, enc = await start(cluster, pre)
    assert cluster.router.orchestrator is not None
    metrics = cluster.router.orchestrator.metrics.registry
    skipped = metrics.get_sample_value("epd:partitions_skipped_total") or 0.0
    result = await cluster.client.generate_text(video_chat(), SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]
    assert metrics.get_sample_value("epd:partitions_skipped_total") == skipped + first
    (video,) = prompt.params.items
    count = len(video.partitions)
    (encode,) = enc.requests
    (item,) = encode.items
    assert list(item.partition_indices) == list(range(first, count))
    patch_rows = video.partitions[-1].input_end - video.partitions[first].input_start
    assert item.pixel_values.shape[0] == patch_rows  # only their patch rows travel
    (request,) = pre.requests
    (emb,) = request.multimodal.embeddings
    assert (emb.partition_start, emb.partition_end) == (first, count)
    assert emb.rows.shape[0] == sum(p.output_rows for p in video.partitions[first:])


async def test_partitions_evicted_meanwhile_are_encoded_whole_and_prefilled_again(
    cluster: Cluster,
) -> None:
    pre = EvictedPrefill()
    prompt, first, enc = await start(cluster, pre)
    result = await cluster.client.generate_text(video_chat(), SamplingParams(max_tokens=2))
    assert result.token_ids == [FIRST, 101]
    assert len(pre.requests) == 2 and len(enc.requests) == 2
    assert list(enc.requests[0].items[0].partition_indices) == list(
        range(first, len(prompt.params.items[0].partitions))
    )
    assert list(enc.requests[1].items[0].partition_indices) == []  # the whole video
    (emb,) = pre.requests[1].multimodal.embeddings
    assert not emb.HasField("partition_start")
    assert emb.rows.shape[0] == prompt.params.items[0].length
