"""Worker answers the router recovers from, against the fake workers of `tests.test_router`.

Pins: a first-token EOS skips decode and releases the KV lease, a decode failure reaches the
client and releases the lease, KV that decode refuses is prefilled again (each try with the
newest handle; past the re-prefills the request is ABORTED), and an UNAVAILABLE worker is
retried on another.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.roles import Role
from common.sampling import SamplingParams
from epd.client import GenerateError
from tests.test_router import FIRST, TEXT, FakePrefill
from tests.test_router import ckpt as ckpt  # fixture
from tests.test_router import cluster as cluster  # fixture
from tests.test_router import workers as workers  # fixture


async def test_first_token_eos_skips_decode_and_releases(cluster, workers, ckpt):
    _, pre, dec = workers
    pre.first = cluster.router.orchestrator.processor.config.eos_token_ids[0]
    result = await cluster.client.generate_text(TEXT)
    assert result.finish_reason == "stop" and len(result.token_ids) == 1
    assert dec.requests == []
    await asyncio.sleep(0.1)
    assert pre.released == ["lease-1"]


async def test_decode_failure_releases_the_lease(cluster, workers):
    _, pre, dec = workers
    dec.fail = grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert err.value.code == grpc.StatusCode.INTERNAL  # the deployment's fault (s44)
    assert "fake decode failure" in err.value.details
    await asyncio.sleep(0.1)
    assert pre.released == ["lease-1"]


async def test_kv_refused_by_decode_is_prefilled_again(cluster, workers):
    _, pre, dec = workers
    dec.refuse_kv = 2
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert result.token_ids == [FIRST, 101, 102, 103]  # the client saw no error
    assert len(pre.requests) == 3  # the first prefill and two more
    # Each decode try got the newest handle and the first token already streamed.
    assert [r.kv.lease_id for r in dec.requests] == ["lease-1", "lease-2", "lease-3"]
    assert {r.first_token_id for r in dec.requests} == {FIRST}
    await asyncio.sleep(0.1)
    assert {"lease-1", "lease-2"} <= set(pre.released)


async def test_kv_refused_past_the_reprefills_is_aborted(cluster, workers):
    _, pre, dec = workers
    dec.refuse_kv = 3
    with pytest.raises(GenerateError) as err:
        await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert err.value.code == grpc.StatusCode.ABORTED
    assert len(pre.requests) == 3


async def test_unavailable_worker_is_retried_on_another(cluster, workers):
    _, pre, _ = workers
    pre.fail = grpc.StatusCode.UNAVAILABLE
    other = FakePrefill()
    await cluster.add(Role.PREFILL, other)
    for _ in range(2):
        result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=2))
        assert result.token_ids == [FIRST, 101]
    assert len(other.requests) == 2


async def test_kv_refused_by_decode_is_prefilled_again_on_another_holder(cluster, workers):
    # The holder did not serve its KV (frozen, slow, changed bytes): with cache-aware
    # routing the prompt went back to it, the worker caching its prefix.
    _, pre, dec = workers
    other = FakePrefill()
    await cluster.add(Role.PREFILL, other)
    dec.refuse_kv = 1
    result = await cluster.client.generate_text(TEXT, SamplingParams(max_tokens=4))
    assert result.token_ids == [FIRST, 101, 102, 103]
    assert len(pre.requests) == len(other.requests) == 1  # one each: not the holder again
