"""The router's failover paths for prefill against fake workers in this event loop
(`tests.test_router`): a prefill worker that fails is retried elsewhere with the items
encoded again; embeddings lost with their encoder are encoded again for the same prefill
worker, which stays trusted; with no prefill worker left the request fails with
UNAVAILABLE naming the role."""

from __future__ import annotations

import grpc
import pytest

from common.handoff import EMBEDDINGS_LOST
from common.roles import Role
from common.sampling import SamplingParams
from epd.client import GenerateError
from tests.test_failover_router import ckpt as ckpt
from tests.test_failover_router import cluster as cluster  # fixtures: a router, fake workers
from tests.test_router import FIRST, IMAGE, TEXT, FakeDecode, FakeEncoder, FakePrefill


class FailingPrefill(FakePrefill):
    """Fails its first `failures` calls with UNAVAILABLE and `details`, then serves."""

    def __init__(self, failures: int, details: str) -> None:
        super().__init__()
        self.failures = failures
        self.details = details

    async def Prefill(self, request, context):
        if self.failures:
            self.failures -= 1
            self.requests.append(request)
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.details)
        return await super().Prefill(request, context)


async def test_a_failed_prefill_is_retried_elsewhere_with_items_encoded_again(cluster):
    enc = FakeEncoder()
    await cluster.add(Role.ENCODER, enc)
    dying = FailingPrefill(10, "Socket closed")
    await cluster.add(Role.PREFILL, dying)
    healthy = FakePrefill()
    await cluster.add(Role.PREFILL, healthy)
    await cluster.add(Role.DECODE, FakeDecode())
    for _ in range(2):
        result = await cluster.client.generate_text(IMAGE, SamplingParams(max_tokens=3))
        assert result.token_ids == [FIRST, 101, 102]
    assert len(dying.requests) >= 1 and len(healthy.requests) == 2
    # The image was encoded again for the retry (its first embeddings may be released).
    assert len(enc.requests) == 2 + len(dying.requests)


async def test_embeddings_lost_with_their_encoder_are_encoded_again(cluster):
    enc = FakeEncoder()
    await cluster.add(Role.ENCODER, enc)
    pre = FailingPrefill(1, f"multimodal.embeddings[0].rows: {EMBEDDINGS_LOST} (READ failed)")
    await cluster.add(Role.PREFILL, pre)  # the only prefill worker: it is kept
    await cluster.add(Role.DECODE, FakeDecode())
    result = await cluster.client.generate_text(IMAGE, SamplingParams(max_tokens=3))
    assert result.token_ids == [FIRST, 101, 102]
    assert len(pre.requests) == 2 and len(enc.requests) == 2


async def test_a_worker_whose_embeddings_were_lost_stays_trusted(cluster):
    # Its encoder lost them, not it: it keeps its prefix cache's traffic, and the retry
    # stays on it (suspect, the retry and every later request went to the other one).
    await cluster.add(Role.ENCODER, FakeEncoder())
    pre = FailingPrefill(1, f"multimodal.embeddings[0].rows: {EMBEDDINGS_LOST} (READ failed)")
    other = FakePrefill()
    await cluster.add(Role.PREFILL, pre)
    await cluster.add(Role.PREFILL, other)
    await cluster.add(Role.DECODE, FakeDecode())
    result = await cluster.client.generate_text(IMAGE, SamplingParams(max_tokens=3))
    assert result.token_ids == [FIRST, 101, 102]
    registry = cluster.router.registry
    assert not any(w.suspect for w in registry.workers(Role.PREFILL))


async def test_no_prefill_worker_left_is_unavailable_naming_the_role(cluster):
    await cluster.add(Role.ENCODER, FakeEncoder())
    for _ in range(2):
        await cluster.add(Role.PREFILL, FailingPrefill(10, "Socket closed"))
    await cluster.add(Role.DECODE, FakeDecode())
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=3))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no prefill worker left" in err.value.details
    assert "127.0.0.1" not in err.value.details  # how many failed, not where
    # Two calls, one retry: the third was never made (there was no worker to make it on).
    assert cluster.router.orchestrator.calls.retries["prefill"] == 1
