"""The router's multimodal path against the fake workers of `tests.test_router`.

Pins: an image's embeddings pass through to prefill only (inline rows, or NIXL handles with
their holder, which prefill releases), embedding leases are released when prefill fails,
prefill goes to the worker caching the prompt's prefix and skips the items it covers (and
encodes them when that cache moved on), and an image seen again goes to prefill with the
router's kept rows (per tenant, never for NIXL handles).
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from common.roles import Role
from common.sampling import SamplingParams
from epd.client import Client, GenerateError
from epd.v1 import admin_service_pb2
from tests.cluster import OTHER_KEY
from tests.test_router import (
    FIRST,
    IMAGE,
    FakeDecode,
    FakeEncoder,
    FakePrefill,
    chat,
    png,
    prompt_hashes,
)
from tests.test_router import ckpt as ckpt  # fixture
from tests.test_router import cluster as cluster  # fixture
from tests.test_router import workers as workers  # fixture


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
    assert cluster.router.orchestrator.metrics.items_skipped._value.get() == 2


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
    # Skipped at first, then encoded after all: not counted as skipped.
    assert cluster.router.orchestrator.metrics.items_skipped._value.get() == 0


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
