"""Admission control end to end (real processes): a burst of ~300-token text requests much
larger than the prefill and decode KV pools hold at once is queued by the router, not
refused, and every answer equals the offline engine's; the same burst past a small queue
limit refuses the overflow with RESOURCE_EXHAUSTED naming the limit and a back-off hint."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from common.engine import Engine
from common.kv.allocator import blocks_for
from common.models.tiny import make_tiny_checkpoint
from common.sampling import SamplingParams
from epd.client import Client, GenerateError, Result
from tests.cluster import Cluster, start_cluster
from tests.test_e2e import reference, user, wait_for

pytestmark = pytest.mark.slow

BLOCK = 16
REQUESTS = 60
SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPT_BLOCKS = 19  # a ~300-token prompt; its decode needs 20 blocks with 8 new tokens
NUM_BLOCKS = 8 * 20  # both pools hold about 8 of the burst at once
SMALL_QUEUE = 5


def burst_prompt(i: int) -> list[dict[str, Any]]:
    """A text prompt of about 300 tokens on the tiny tokenizer, its own from the first block."""
    return user(f"Request {i}: " + "tell me a story about the sea and the sky " * 15)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: Any) -> Any:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(ckpt: Any) -> Engine:
    return Engine.from_pretrained(ckpt, block_size=BLOCK, num_blocks=64)


def deployment(ckpt: Any, log_dir: Any, *router_args: str) -> Cluster:
    return start_cluster(
        ckpt, log_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS, router_args=router_args
    )


async def capacity_known(cluster: Cluster) -> None:
    """Wait until every KV worker has heartbeated its pool, so the router accounts it."""
    await wait_for(
        lambda s: sum(w.load.kv_blocks_free == NUM_BLOCKS for w in s.workers) == 2, cluster
    )


async def burst(cluster: Cluster) -> list[Result | GenerateError]:
    async with Client(cluster.address, api_key=cluster.client_key) as client:

        async def one(i: int) -> Result | GenerateError:
            try:
                return await client.generate_text(burst_prompt(i), SAMPLING, timeout_s=120)
            except GenerateError as exc:
                return exc

        return await asyncio.gather(*(one(i) for i in range(REQUESTS)))


async def test_a_burst_larger_than_the_pools_is_queued_not_refused(
    ckpt: Any, engine: Engine, tmp_path: Any
) -> None:
    prompt = engine.process(burst_prompt(0)).prompt_token_ids
    assert blocks_for(len(prompt), BLOCK) == PROMPT_BLOCKS  # ~300 tokens, as the issue
    cluster = deployment(ckpt, tmp_path)
    try:
        await capacity_known(cluster)
        results = await burst(cluster)
        status = await asyncio.to_thread(cluster.status)
    finally:
        cluster.stop()
    errors = [r for r in results if isinstance(r, GenerateError)]
    assert errors == []
    assert status.refused_requests == 0 and status.queued_requests == 0
    assert status.admitted_requests == REQUESTS
    assert status.queued_peak > 0  # the burst waited in the router (about 50 at once)
    assert status.queue_wait_max_s > 0
    assert all(w.router_reserved_kv_blocks == 0 for w in status.workers)
    for i in range(0, REQUESTS, 12):  # a sample against the offline engine
        result = results[i]
        assert isinstance(result, Result)
        assert result.token_ids == reference(engine, burst_prompt(i), SAMPLING), i


async def test_the_burst_past_a_small_queue_is_refused_with_the_limit(
    ckpt: Any, engine: Engine, tmp_path: Any
) -> None:
    cluster = deployment(ckpt, tmp_path, "--max-queued-requests", str(SMALL_QUEUE))
    try:
        await capacity_known(cluster)
        results = await burst(cluster)
        status = await asyncio.to_thread(cluster.status)
    finally:
        cluster.stop()
    errors = [r for r in results if isinstance(r, GenerateError)]
    done = [(i, r) for i, r in enumerate(results) if isinstance(r, Result)]
    assert errors and len(done) >= SMALL_QUEUE
    for exc in errors:
        assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max_queued_requests={SMALL_QUEUE}" in exc.details
        assert "retry after" in exc.details
    assert status.refused_requests == len(errors)
    assert status.admitted_requests == len(done)
    assert status.queued_peak <= SMALL_QUEUE + status.requeued_requests  # requeues go ahead
    i, result = done[-1]
    assert result.token_ids == reference(engine, burst_prompt(i), SAMPLING)
