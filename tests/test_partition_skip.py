"""The partition skip rule (`router.pieces.pieces_past` / `partitions_past`) and the prefill
worker's placing of a video given only some partitions' rows
(`prefill_worker.partitions.split_for_prefill`), through the real processor.

A prefill worker whose cached prefix is the prompt's first `covered` tokens needs the
embeddings of each piece with a placeholder at or past `covered`: a video's partitions whose
runs end inside the prefix are neither encoded nor sent. The worker places such a video as
its pieces: the block hashes and mRoPE positions are the whole prompt's, and it signs the
whole prompt's digest (what decode checks) because it takes the whole layout as given.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.kv.hashing import block_hashes, prompt_digest
from common.models.qwen3_vl.rope import prompt_positions
from common.multimodal.validation import MultimodalLayoutError
from common.processing.processor import ProcessedPrompt, Processor
from common.wire.convert import params_from_proto, tensor_from_ref, tensor_to_ref
from epd.v1 import multimodal_pb2
from prefill_worker.partitions import split_for_prefill
from router.pieces import partitions_past, pieces_past
from tests.model_fixtures import write_tiny_checkpoint

MERGE = 2  # the tiny checkpoint's spatial merge


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> ProcessedPrompt:
    processor = Processor.from_pretrained(
        write_tiny_checkpoint(tmp_path_factory.mktemp("ps") / "c")
    )
    rng = np.random.default_rng(7)
    content = [
        {"type": "text", "text": "First this: "},
        {"type": "image", "image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
        {"type": "text", "text": "then a clip:"},
        {"type": "video", "video": rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8), "fps": 2},
        {"type": "text", "text": "What moved?"},
    ]
    return processor.process([{"role": "user", "content": content}])


def test_only_the_partitions_past_the_cached_prefix_are_needed(prompt: ProcessedPrompt) -> None:
    image, video = prompt.params.items
    runs = video.runs
    assert video.partition_keys and len(runs) == 4
    both = [0, 1]
    # Nothing cached: every piece, the video whole.
    assert [(p.item, p.partition) for p in pieces_past(prompt.params.items, both, 0)] == [
        (0, None),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
    ]
    assert partitions_past(prompt.params.items, both, 0) == {}
    # Cached through the end of the video's second run: the image and the first two
    # partitions are not needed.
    covered = runs[1][0] + runs[1][1]
    assert [p.partition for p in pieces_past(prompt.params.items, both, covered)] == [2, 3]
    assert partitions_past(prompt.params.items, both, covered) == {1: 2}
    # One token short of that: the second partition's last placeholder is computed.
    assert partitions_past(prompt.params.items, both, covered - 1) == {1: 1}
    # A prefix ending inside the image (not partitioned): the image whole, the video whole.
    inside = image.position + 1
    assert partitions_past(prompt.params.items, both, inside) == {}
    assert [p.item for p in pieces_past(prompt.params.items, both, inside)][:1] == [0]


def with_rows(msg: multimodal_pb2.MultimodalParams, item: int, start: int, stop: int, rows: int):
    emb = msg.embeddings.add(item_index=item, rows=tensor_to_ref(torch.randn(rows, 4)))
    emb.deepstack.append(tensor_to_ref(torch.randn(rows, 4)))
    if stop:
        emb.partition_start, emb.partition_end = start, stop
    return emb


def test_a_video_given_some_partitions_hashes_places_and_digests_as_the_whole_prompt(
    prompt: ProcessedPrompt,
) -> None:
    tokens, params = prompt.prompt_token_ids, prompt.params
    video = params.items[1]
    msg = params.to_proto()
    rows = sum(p.output_rows for p in video.partitions[2:])
    given = with_rows(msg, 1, 2, 4, rows)
    whole, split, origins = split_for_prefill(msg)
    assert whole is not None and origins == [0, 1, 1]  # each piece's item
    assert prompt_digest(tokens, whole) == prompt_digest(tokens, params)
    pieces = params_from_proto(split, with_embeddings=True)
    # The image, then the video's partitions [0, 2) (no rows) and [2, 4) (the rows given).
    assert [it.runs for it in pieces.items] == [
        params.items[0].runs,
        video.runs[:2],
        video.runs[2:],
    ]
    assert sorted(pieces.embeddings) == [2]
    assert torch.equal(pieces.embeddings[2].rows, tensor_from_ref(given.rows))
    assert torch.equal(pieces.embeddings[2].deepstack[0], tensor_from_ref(given.deepstack[0]))
    for block in (1, 4, 16):
        assert block_hashes(tokens, block, pieces) == block_hashes(tokens, block, params)
    whole_positions = prompt_positions(len(tokens), params.items, MERGE)
    split_positions = prompt_positions(len(tokens), pieces.items, MERGE)
    assert torch.equal(split_positions.positions, whole_positions.positions)
    # Without partition rows the message is taken as it is.
    plain = params.to_proto()
    assert split_for_prefill(plain) == (None, plain, None)


def test_partition_spans_that_do_not_fit_are_refused_naming_the_field(
    prompt: ProcessedPrompt,
) -> None:
    params = prompt.params
    video = params.items[1]
    cases = []
    msg = params.to_proto()
    with_rows(msg, 1, 3, 5, 4)  # past the video's 4 partitions
    cases.append(msg)
    msg = params.to_proto()
    with_rows(msg, 1, 1, 3, 4)
    with_rows(msg, 1, 2, 4, 4)  # overlaps the span before
    cases.append(msg)
    msg = params.to_proto()
    with_rows(msg, 0, 0, 1, 4)  # the image has no partitions
    cases.append(msg)
    msg = params.to_proto()
    with_rows(msg, 1, 0, 0, video.length)  # whole rows and partition rows
    with_rows(msg, 1, 2, 4, 4)
    cases.append(msg)
    for msg in cases:
        with pytest.raises(MultimodalLayoutError) as err:
            split_for_prefill(msg)
        assert err.value.field == "embeddings.partition_start"


@pytest.mark.parametrize("index", [0, 2])
def test_whole_rows_for_no_item_or_an_item_twice_are_refused_beside_a_span(
    prompt: ProcessedPrompt, index: int
) -> None:
    # Without a span `embeddings_from_proto` refuses these; with one the split must too,
    # rather than keep one copy and leave the other's transfer handle unpulled.
    params = prompt.params
    image = params.items[0]
    msg = params.to_proto()
    with_rows(msg, 0, 0, 0, image.length)
    with_rows(msg, index, 0, 0, image.length)  # the image again, or an item there is not
    with_rows(msg, 1, 2, 4, 4)
    with pytest.raises(MultimodalLayoutError, match="no such item or repeated") as err:
        split_for_prefill(msg)
    assert (err.value.field, err.value.item) == ("embeddings.item_index", index)
