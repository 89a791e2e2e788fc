"""The prefill worker's embeddings: pulled by NIXL from an encoder's handles, they give the
inline result and the encoder's lease is released; they are needed only past the cached prefix
(a video wholly in it needs none, one not cached yet is FAILED_PRECONDITION). In-process gRPC
servers on 127.0.0.1 with real NIXL agents."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from common.engine import Engine
from common.multimodal.params import MultimodalParams
from common.server.role import RoleServer
from common.server.rpc import start_server
from common.transfer.agent import TransferAgent
from common.wire.transfer import handle_for
from epd.v1 import (
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    multimodal_pb2,
    prefill_service_pb2,
)
from tests.test_kv_handoff import (
    GREEDY,
    eventually,
    make_handoff,
    prefill_request,
    user,
    vid_part,
)
from tests.test_prefill_worker import ckpt, engine, settle, stub, worker

__all__ = ["ckpt", "engine", "stub", "worker"]  # module fixtures shared with test_prefill_worker

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _by_handle(params: MultimodalParams, agent: TransferAgent) -> multimodal_pb2.MultimodalParams:
    """The wire params with every embedding tensor held by a NIXL handle of `agent` (which
    keeps the registered tensors alive)."""
    from common.wire.convert import params_to_proto

    msg = params_to_proto(params)
    for emb in msg.embeddings:
        source = params.embeddings[emb.item_index]
        for ref, tensor in zip(
            [emb.rows, *emb.deepstack], [source.rows, *source.deepstack], strict=True
        ):
            ref.handle.CopyFrom(handle_for(tensor.contiguous(), agent, lease_id="enc-lease"))
    return msg


class FakeEncoder(encoder_service_pb2_grpc.EncoderServiceServicer):
    """Records ReleaseEmbeddings calls."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def ReleaseEmbeddings(
        self, request: encoder_service_pb2.ReleaseEmbeddingsRequest, context: Any
    ) -> encoder_service_pb2.ReleaseEmbeddingsResponse:
        self.released.extend(request.lease_ids)
        return encoder_service_pb2.ReleaseEmbeddingsResponse(released=len(request.lease_ids))


async def test_embeddings_pulled_by_nixl_give_the_inline_result(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    await settle(worker, stub)
    tokens, params = make_handoff(engine, user(vid_part(21, 4), "What is this?"))
    inline = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=inline.kv.lease_id))
    worker.servicer.runner.allocator.pool.reset_prefix_cache()  # compute everything again
    fake = FakeEncoder()
    encoder_server = await start_server(
        [lambda s: encoder_service_pb2_grpc.add_EncoderServiceServicer_to_server(fake, s)]
    )
    try:
        with TransferAgent("encoder") as encoder:
            request = prefill_request(tokens, params, GREEDY)
            request.multimodal.CopyFrom(_by_handle(params, encoder))
            request.embedding_holders["enc-lease"] = encoder_server.address
            assert request.multimodal.embeddings[0].rows.WhichOneof("data") == "handle"
            pulled = await stub.Prefill(request, timeout=30)
        await eventually(lambda: fake.released == ["enc-lease"])
    finally:
        await encoder_server.stop(0)
    await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=pulled.kv.lease_id))
    assert pulled.first_token_id == inline.first_token_id
    assert pulled.cached_tokens == 0
    assert list(pulled.kv.block_hashes) == list(inline.kv.block_hashes)


async def test_embeddings_only_needed_past_the_cached_prefix(
    worker: RoleServer[Any], stub: Any, engine: Engine
) -> None:
    await settle(worker, stub)
    shared = "This long preamble about the clip is shared by both of the questions below."
    first = user(vid_part(22, 4), shared, "Who is there?")
    second = user(vid_part(22, 4), shared, "What colour dominates?")
    tokens, params = make_handoff(engine, second)
    bare = MultimodalParams(params.items, {}, params.mrope_position_delta)
    # Video not cached yet: its embeddings are required.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Prefill(prefill_request(tokens, bare, GREEDY), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert worker.servicer.runner.allocator.pool.num_used_blocks == 0
    t1, p1 = make_handoff(engine, first)
    r1 = await stub.Prefill(prefill_request(t1, p1, GREEDY), timeout=30)
    await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=r1.kv.lease_id))
    # Now the whole video lies in the cached prefix: no embeddings needed.
    with_emb = await stub.Prefill(prefill_request(tokens, params, GREEDY), timeout=30)
    without = await stub.Prefill(prefill_request(tokens, bare, GREEDY), timeout=30)
    for reply in (with_emb, without):
        await stub.ReleaseKv(prefill_service_pb2.ReleaseKvRequest(lease_id=reply.kv.lease_id))
    assert without.cached_tokens >= params.items[0].end
    assert without.first_token_id == with_emb.first_token_id
