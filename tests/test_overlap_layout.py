"""The layouts of overlapped prefill steps (`router.pieces`), through the real processor.

A step over tokens `[0, n)`, `n` the first placeholder of a piece, must give the whole
prompt's block hashes and mRoPE positions for every token before `n` (a cut video as one
item per piece, a span of partitions, or per partition without one), and carry only the
embeddings of items reaching past the reused tokens. The pieces a video is encoded as
(`batched`) are small at both ends and cover its partitions once, in order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from common.kv.hashing import block_hashes
from common.models.qwen3_vl.rope import prompt_positions
from common.processing.processor import ProcessedPrompt, Processor
from common.wire.convert import params_from_proto, tensor_to_ref
from epd.v1 import multimodal_pb2
from router.pieces import Piece, batched, piece_sizes, pieces_of, pieces_past, step_layout
from tests.model_fixtures import write_tiny_checkpoint

MERGE = 2  # the tiny checkpoint's spatial merge


@pytest.fixture(scope="module")
def processor(tmp_path_factory: pytest.TempPathFactory) -> Processor:
    return Processor.from_pretrained(write_tiny_checkpoint(tmp_path_factory.mktemp("ov") / "c"))


def without_partition_keys(processor: Processor) -> Processor:
    settings = dataclasses.replace(processor.settings, video_partition_keys=False)
    return Processor(
        processor.tokenizer, processor.config, settings, processor.template, processor.generation
    )


def prompt(processor: Processor) -> ProcessedPrompt:
    rng = np.random.default_rng(5)
    clip = rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    content = [
        {"type": "text", "text": "A report to read first. " * 4},
        {"type": "image", "image": image},
        {"type": "text", "text": "and a clip:"},
        {"type": "video", "video": clip, "fps": 2.0},
        {"type": "text", "text": "Compare them."},
    ]
    return processor.process([{"role": "user", "content": content}])


def whole_item_embedding(index: int, rows: int) -> multimodal_pb2.ItemEmbedding:
    data = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 1000 * index
    return multimodal_pb2.ItemEmbedding(item_index=index, rows=tensor_to_ref(data))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("partition_keys", [True, False])
def test_every_step_hashes_and_positions_as_the_whole_prompt(
    processor: Processor, block_size: int, partition_keys: bool
) -> None:
    p = prompt(processor if partition_keys else without_partition_keys(processor))
    tokens, params = p.prompt_token_ids, p.params
    pieces = pieces_of(params.items, range(len(params.items)))
    # The image is one piece; the video one per temporal patch, or one when not keyed so.
    assert len(pieces) == (5 if partition_keys else 2)
    whole_hashes = block_hashes(tokens, block_size, params)
    whole = prompt_positions(len(tokens), params.items, MERGE).positions
    for piece in pieces:
        n = piece.start
        step = params_from_proto(step_layout(params, n, {}, n), with_embeddings=False)
        before = [i for i in pieces if i.end <= n]
        assert sum(item.length for item in step.items) == sum(i.end - i.start for i in before)
        assert block_hashes(tokens[:n], block_size, step) == whole_hashes[: n // block_size]
        positions = prompt_positions(n, step.items, MERGE).positions
        assert torch.equal(positions, whole[:, :n])


def test_a_step_carries_only_the_embeddings_reaching_past_what_it_reuses(
    processor: Processor,
) -> None:
    p = prompt(processor)
    params = p.params
    pieces = pieces_of(params.items, [0, 1])
    image, *video = pieces
    arrived: dict[Piece, multimodal_pb2.ItemEmbedding] = {
        image: whole_item_embedding(0, image.end - image.start)
    }
    for piece in video[:2]:
        arrived[piece] = whole_item_embedding(10 + (piece.partition or 0), piece.end - piece.start)
    n = video[2].start  # the video's first two partitions are in
    everything = step_layout(params, n, arrived, reused=0)
    assert [e.item_index for e in everything.embeddings] == [0, 1, 2]
    # Reusing up to the second partition's first token: that partition alone.
    some = step_layout(params, n, arrived, reused=video[1].start)
    assert [e.item_index for e in some.embeddings] == [2]
    assert some.embeddings[0].rows == arrived[video[1]].rows
    decoded = params_from_proto(some, with_embeddings=True)
    assert decoded.items[2].runs == (params.items[1].runs[1],)
    assert decoded.items[2].partitions[0].content_hash == params.items[1].partitions[1].content_hash


def test_piece_sizes_double_from_both_ends_up_to_the_largest() -> None:
    assert piece_sizes(24, 4) == [1, 2, 4, 4, 2, 4, 4, 2, 1]
    assert piece_sizes(4, 8) == [1, 2, 1]
    assert piece_sizes(1, 4) == [1] and piece_sizes(0, 4) == []
    for count in range(40):
        for largest in (1, 2, 3, 4, 8):
            sizes = piece_sizes(count, largest)
            assert sum(sizes) == count and all(1 <= s <= largest for s in sizes)
            assert count < 2 or sizes[0] == sizes[-1] == 1
    with pytest.raises(ValueError, match="at least 1"):
        piece_sizes(3, 0)


@pytest.mark.parametrize("largest", [1, 2, 4])
@pytest.mark.parametrize("covered", [0, 1])
def test_steps_over_batched_pieces_hash_and_position_as_the_whole_prompt(
    processor: Processor, largest: int, covered: int
) -> None:
    p = prompt(processor)
    tokens, params = p.prompt_token_ids, p.params
    units = pieces_of(params.items, range(len(params.items)))
    # `covered`: the worker caches the prompt up to the video's second partition.
    cut = units[2].start if covered else 0
    pieces = batched(pieces_past(params.items, range(len(params.items)), cut), largest)
    video = [q for q in pieces if q.partition is not None]
    assert [q.width for q in video] == piece_sizes(4 - covered, largest)  # 4 temporal patches
    assert [r for q in video for r in q.partitions] == list(range(covered, 4))
    block = 4
    whole_hashes = block_hashes(tokens, block, params)
    whole = prompt_positions(len(tokens), params.items, MERGE).positions
    arrived: dict[Piece, multimodal_pb2.ItemEmbedding] = {}
    for k, piece in enumerate(pieces):
        n = piece.start
        layout = step_layout(params, n, arrived, reused=0)
        step = params_from_proto(layout, with_embeddings=False)
        assert block_hashes(tokens[:n], block, step) == whole_hashes[: n // block]
        assert torch.equal(prompt_positions(n, step.items, MERGE).positions, whole[:, :n])
        # Every arrived piece is one item carrying its rows; cached partitions carry none.
        assert len(layout.embeddings) == k
        item = params.items[piece.item]
        rows = sum(item.runs[j][1] for j in piece.partitions) or item.length
        arrived[piece] = whole_item_embedding(k, rows)
