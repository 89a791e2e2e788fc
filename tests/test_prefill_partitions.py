"""A prefill worker given a video's rows for only the partitions past its cached prefix
(`ItemEmbedding.partition_start`, `prefill_worker.partitions`): the real worker, in process,
on the tiny checkpoint.

After V is prefilled, V with frames appended, carrying only the new partitions' rows, gives
the first token, block hashes and prompt digest of the same prompt with every row; once the
worker's cache no longer holds V, the same request is FAILED_PRECONDITION with no block
taken (the router then encodes everything and prefills again).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from common.engine import Engine
from common.server.role import RoleServer
from common.server.rpc import channel
from common.wire.convert import tensor_to_ref
from epd.v1 import prefill_service_pb2, prefill_service_pb2_grpc
from prefill_worker.server import serve as serve_prefill
from prefill_worker.settings import PrefillSettings
from tests.cluster import cluster_credentials, cluster_security
from tests.test_kv_handoff import (
    BLOCK,
    GREEDY,
    ckpt,
    engine,
    make_handoff,
    prefill_request,
    user,
    video,
)

__all__ = ["ckpt", "engine"]  # module fixtures shared with test_kv_handoff

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stub(ckpt: Path) -> AsyncIterator[Any]:
    server: RoleServer[Any] = await serve_prefill(
        PrefillSettings(
            model=str(ckpt), block_size=BLOCK, num_blocks=128, security=cluster_security()
        )
    )
    try:
        async with channel(server.address, credentials=cluster_credentials()) as ch:
            yield prefill_service_pb2_grpc.PrefillServiceStub(ch), server
    finally:
        await server.stop(0)


def ask(frames: Any) -> Any:
    return user("Clip:", {"type": "video", "video": frames, "fps": 2.0}, "What moves?")


async def prefill(stub: Any, server: Any, request: prefill_service_pb2.PrefillRequest) -> Any:
    """Prefill, release the lease and wait until its blocks are back in the pool."""
    reply = await stub.Prefill(request, timeout=60)
    await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id))
    await server.servicer.settle_releases()
    return reply


async def test_only_the_new_partitions_rows_give_the_whole_prompts_prefill(
    stub: Any, engine: Engine
) -> None:
    prefill_stub, server = stub
    pool = server.servicer.runner.allocator.pool
    frames = video(61, 12)
    first, second = ask(frames[:8]), ask(frames)  # 4 temporal patches, then 6
    t1, p1 = make_handoff(engine, first)
    tokens, params = make_handoff(engine, second)
    (item,) = params.items
    assert item.partition_keys and len(item.partitions) == 6
    whole = prefill_request(tokens, params, GREEDY)
    # The rows of partitions 4 and 5 only (V's 4 are cached once V is prefilled).
    emb = params.embeddings[0]
    rows = sum(p.output_rows for p in item.partitions[:4])
    partial = prefill_request(tokens, params, GREEDY, rid="partial")
    del partial.multimodal.embeddings[:]
    given = partial.multimodal.embeddings.add(
        item_index=0, rows=tensor_to_ref(emb.rows[rows:]), partition_start=4, partition_end=6
    )
    given.deepstack.extend(tensor_to_ref(d[rows:]) for d in emb.deepstack)

    pool.reset_prefix_cache()
    reference = await prefill(prefill_stub, server, whole)
    pool.reset_prefix_cache()
    await prefill(prefill_stub, server, prefill_request(t1, p1, GREEDY, rid="v"))
    got = await prefill(prefill_stub, server, partial)
    assert got.cached_tokens >= (item.runs[3][0] + item.runs[3][1]) // BLOCK * BLOCK
    assert got.first_token_id == reference.first_token_id
    assert list(got.kv.block_hashes) == list(reference.kv.block_hashes)
    assert got.kv.prompt_digest == reference.kv.prompt_digest  # what decode checks

    pool.reset_prefix_cache()  # V evicted: partitions 0-3 must be computed, without rows
    used = pool.num_used_blocks
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await prefill_stub.Prefill(partial, timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert pool.num_used_blocks == used
