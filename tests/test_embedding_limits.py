"""Limits before work (DESIGN §7) for the embeddings of a handoff: `read_handoff` checks
every embedding's declared shapes against the model (rows `[item length, hidden]`, the
model's deepstack depth, each deepstack tensor of the rows' shape, a floating element type)
from the wire fields alone, before it pulls any tensor a transfer handle holds, since a
pull allocates whatever shape the peer declared.

The pulls go through a resolver that records its calls, standing in for the prefill
worker's NIXL READ; the model is the built-in tiny checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.engine import Engine
from common.handoff import read_handoff
from common.multimodal.validation import MultimodalLayoutError
from common.wire.convert import params_to_proto
from epd.v1 import multimodal_pb2, tensor_pb2
from tests.test_kv_handoff import img_part, make_handoff, user, vid_part

Message = multimodal_pb2.MultimodalParams


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Engine:
    return Engine.from_pretrained(ckpt, block_size=4, num_blocks=256)


@pytest.fixture(scope="module")
def handoff(engine: Engine) -> tuple[list[int], Message]:
    """An image and a video, every embedding tensor held by a (fake) transfer handle."""
    tokens, params = make_handoff(engine, user(img_part(1), "and", vid_part(2), "what?"))
    msg = params_to_proto(params)
    for emb in msg.embeddings:
        for ref in (emb.rows, *emb.deepstack):
            to_handle(ref, list(ref.shape))
    return tokens, msg


def to_handle(ref: tensor_pb2.TensorRef, shape: list[int]) -> None:
    """`ref` as a handle to a tensor of `shape` (float32) on a peer."""
    ref.dtype = tensor_pb2.ELEMENT_TYPE_FLOAT32
    ref.shape[:] = shape
    ref.handle.agent_metadata = b"peer"
    ref.handle.agent_name = "peer"
    ref.handle.length = 4 * int(torch.Size(shape).numel())
    ref.handle.lease_id = "lease"


def wider(msg: Message) -> None:
    rows = msg.embeddings[1].rows
    to_handle(rows, [rows.shape[0], 1 << 24])


def deeper(msg: Message) -> None:
    emb = msg.embeddings[1]
    for _ in range(1000):
        to_handle(emb.deepstack.add(), list(emb.rows.shape))


def shallower(msg: Message) -> None:
    msg.embeddings[1].deepstack.pop()


def odd_layer(msg: Message) -> None:
    layer = msg.embeddings[1].deepstack[1]
    to_handle(layer, [layer.shape[0], 1 << 24])


def integer_layer(msg: Message) -> None:
    msg.embeddings[1].deepstack[0].dtype = tensor_pb2.ELEMENT_TYPE_INT64


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        (wider, "embeddings.rows", r"shape \[\d+, 16777216\], the item needs \[\d+, 64\]"),
        (deeper, "embeddings.deepstack", "1002 layers, the model has 2"),
        (shallower, "embeddings.deepstack", "1 layers, the model has 2"),
        (odd_layer, "embeddings.deepstack", r"layer 1 has shape \[\d+, 16777216\]"),
        (integer_layer, "embeddings.deepstack", "ELEMENT_TYPE_INT64 is not a floating type"),
    ],
)
def test_declared_shapes_that_do_not_fit_the_model_are_refused_before_any_pull(
    engine: Engine,
    handoff: tuple[list[int], Message],
    mutate: Callable[[Message], None],
    field: str,
    message: str,
) -> None:
    tokens, sent = handoff
    msg = Message()
    msg.CopyFrom(sent)
    mutate(msg)  # the second item's embedding: the first's, which fits, is not pulled either
    pulls: list[str] = []
    with pytest.raises(MultimodalLayoutError) as info:
        read_handoff(engine.runner, tokens, msg, with_embeddings=True, resolve=recorder(pulls))
    assert pulls == []
    assert (info.value.field, info.value.item) == (field, 1)
    assert re.search(message, str(info.value)), str(info.value)


def test_shapes_that_fit_are_pulled_each_once(
    engine: Engine, handoff: tuple[list[int], Message]
) -> None:
    tokens, msg = handoff
    pulls: list[str] = []
    got = read_handoff(engine.runner, tokens, msg, with_embeddings=True, resolve=recorder(pulls))
    assert pulls == ["embeddings.rows", "embeddings.deepstack", "embeddings.deepstack"] * 2
    for index, emb in got.params.embeddings.items():
        assert emb.rows.shape == (got.params.items[index].length, 64)
        assert [d.shape for d in emb.deepstack] == [emb.rows.shape] * 2


def recorder(pulls: list[str]) -> Callable[[tensor_pb2.TensorRef, str], torch.Tensor]:
    """A resolver that notes each pull's field and gives zeros of the declared shape (the
    refused shapes never reach it: nothing is pulled for them)."""

    def resolve(ref: tensor_pb2.TensorRef, field: str) -> torch.Tensor:
        pulls.append(field)
        return torch.zeros(list(ref.shape))

    return resolve
