"""Hostile inputs (issue 10) at the workers: a real encoder worker trusts no hash a caller
sends (an item's or a partition's content hash that does not match its pixels is refused, and a
forged one cannot make one item answer with another's cached rows); the wire refuses embedding
rows of a type it cannot read; the KV workers check LoRA and context first.

Router-side limits are in tests/test_limits.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from common.errors import FieldError
from common.handoff import check_request
from common.multimodal.validation import MultimodalLayoutError
from common.processing.content_hash import content_hash, partitioned_content_hash
from common.processing.processor import ProcessedPrompt, Processor
from common.server.role import RoleServer
from common.server.rpc import channel
from common.wire.convert import params_from_proto, params_to_proto, tensor_from_ref, tensor_to_ref
from encoder_worker.server import EncoderServicer, serve
from encoder_worker.settings import EncoderSettings
from epd.v1 import (
    decode_service_pb2,
    encoder_service_pb2,
    encoder_service_pb2_grpc,
    prefill_service_pb2,
    tensor_pb2,
)
from tests.cluster import cluster_credentials, cluster_security
from tests.encoder_worker_helpers import _item

# ------------------------------------------------------------ encoder: no trusted hash


@pytest.fixture
async def encoder(ckpt: Path) -> AsyncIterator[tuple[RoleServer[EncoderServicer], Any]]:
    server = await serve(EncoderSettings(model=str(ckpt), nixl=False, security=cluster_security()))
    async with channel(server.address, credentials=cluster_credentials()) as ch:
        yield server, encoder_service_pb2_grpc.EncoderServiceStub(ch)
    await server.stop(0)


def _prompt(processor: Processor, seed: int, kind: str = "image") -> ProcessedPrompt:
    rng = np.random.default_rng(seed)
    if kind == "image":
        part: dict[str, Any] = {
            "type": "image",
            "image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
        }
    else:
        frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(4)]
        part = {"type": "video", "video": frames, "fps": 2.0}
    return processor.process([{"role": "user", "content": [part]}])


async def _refused(stub: Any, item: encoder_service_pb2.EncodeItem) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Encode(encoder_service_pb2.EncodeRequest(items=[item]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details() or ""


async def test_forged_hash_cannot_make_x_answer_like_y(
    encoder: tuple[RoleServer[EncoderServicer], Any], processor: Processor
) -> None:
    server, stub = encoder
    x, y = _prompt(processor, 1), _prompt(processor, 2)
    forged = _item(y)
    forged.content_hash = x.params.items[0].content_hash  # Y's pixels under X's hash
    assert "content_hash" in await _refused(stub, forged)
    engine = server.servicer.engine
    assert len(engine.cache) == 0 and engine.forward_calls == 0
    # The honest answer about X is X's, not Y's.
    honest = encoder_service_pb2.EncodeRequest(items=[_item(x), _item(y)])
    reply = await stub.Encode(honest, timeout=30)
    rows_x, rows_y = (tensor_from_ref(item.rows) for item in reply.items)
    assert not torch.equal(rows_x, rows_y)
    assert engine.cache.keys() == [x.params.items[0].content_hash, y.params.items[0].content_hash]


async def test_forged_partition_hash_and_unknown_modality_are_refused(
    encoder: tuple[RoleServer[EncoderServicer], Any], processor: Processor
) -> None:
    server, stub = encoder
    v, w = _prompt(processor, 3, "video"), _prompt(processor, 4, "video")
    forged = _item(v)
    forged.partitions[1].content_hash = w.params.items[0].partitions[1].content_hash
    forged.partition_indices.extend([1])
    part = v.params.items[0].partitions[1]
    # Only partition 1's rows: the item's own hash cannot be checked, the partition's is.
    rows = v.pixel_values[0][part.input_start : part.input_end]
    forged.pixel_values.CopyFrom(tensor_to_ref(rows))
    assert "partitions[1].content_hash" in await _refused(stub, forged)
    odd = _item(_prompt(processor, 5))
    odd.modality = 9  # type: ignore[assignment]
    details = await _refused(stub, odd)
    assert "modality" in details and "9" in details
    assert len(server.servicer.engine.cache) == 0


async def test_a_whole_video_under_another_videos_item_hash_is_refused(
    encoder: tuple[RoleServer[EncoderServicer], Any], processor: Processor
) -> None:
    """A video's item hash is the hash of its partitions' hashes: with every partition's
    rows and honest partition hashes, a claimed item hash that is not theirs (another
    video's) is refused before anything is cached."""
    server, stub = encoder
    v, w = _prompt(processor, 7, "video"), _prompt(processor, 8, "video")
    item = v.params.items[0]
    assert item.grid_thw is not None
    assert item.content_hash == partitioned_content_hash(
        processor.settings.fingerprint(),
        "video",
        v.pixel_values[0],
        item.grid_thw,
        [p.content_hash for p in item.partitions],
    )
    forged = _item(v)
    forged.content_hash = w.params.items[0].content_hash
    details = await _refused(stub, forged)
    assert "content_hash" in details and "partitions[" not in details
    assert len(server.servicer.engine.cache) == 0
    reply = await stub.Encode(
        encoder_service_pb2.EncodeRequest(items=[_item(v)]),
        timeout=30,
    )
    assert reply.items[0].content_hash == item.content_hash
    # A router from before partition-hashed items names a video by all its rows: also
    # exact, so accepted (a rolling upgrade), and the two schemes never name the same item.
    over_rows = content_hash(
        processor.settings.fingerprint(), "video", v.pixel_values[0], item.grid_thw
    )
    assert over_rows != item.content_hash
    older = _item(v)
    older.content_hash = over_rows
    reply = await stub.Encode(encoder_service_pb2.EncodeRequest(items=[older]), timeout=30)
    assert reply.items[0].content_hash == over_rows


# --------------------------------------------------------------- wire and KV workers


def test_int64_embedding_rows_are_refused_before_decoding(processor: Processor) -> None:
    prompt = _prompt(processor, 6)
    msg = params_to_proto(prompt.params)
    length = prompt.params.items[0].length
    rows = msg.embeddings.add(item_index=0)
    rows.rows.CopyFrom(tensor_to_ref(torch.zeros(length, 8, dtype=torch.int64)))
    with pytest.raises(MultimodalLayoutError) as info:
        params_from_proto(msg)
    assert info.value.field == "embeddings.rows" and "ELEMENT_TYPE_INT64" in str(info.value)
    rows.rows.dtype = 77
    with pytest.raises(MultimodalLayoutError, match="element type 77"):
        params_from_proto(msg)
    assert tensor_pb2.ELEMENT_TYPE_INT64  # the wire does define int64, for token ids


@pytest.mark.parametrize(
    "kind", [prefill_service_pb2.PrefillRequest, decode_service_pb2.DecodeRequest]
)
def test_kv_workers_check_lora_and_context_first(processor: Processor, kind: Any) -> None:
    from common.sampling import SamplingParams

    runner: Any = dataclasses.make_dataclass("R", ["config"])(processor.config)
    context = processor.config.text.max_position_embeddings
    check_request(runner, [1] * 10, SamplingParams(max_tokens=context - 10), kind())
    with pytest.raises(FieldError) as info:
        check_request(runner, [1] * 10, SamplingParams(max_tokens=context - 9), kind())
    assert info.value.field == "sampling.max_tokens"
    with pytest.raises(FieldError, match="unknown lora_id") as info:
        check_request(runner, [1] * 10, SamplingParams(), kind(lora_id="adapter"))
    assert info.value.field == "lora_id"
    check_request(runner, [1] * 10, SamplingParams(), kind(lora_id=""))
