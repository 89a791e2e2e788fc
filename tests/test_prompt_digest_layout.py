"""`prompt_digest` binds a KV handle to what no full block's hash covers: an item whose
placeholders lie only in the partial last block, and the layout fields no block key names
(grid_thw, frame timestamps, modality, the mRoPE delta). With the layout left out of the
digest every other test passed (invariants review, a mutation)."""

from __future__ import annotations

import dataclasses

import pytest

from common.kv.hashing import block_hashes, prompt_digest
from common.multimodal.params import Modality, MultimodalItemMetadata, MultimodalParams

BS = 4
A, B = b"\xaa" * 32, b"\xbb" * 32
PAD = 9  # placeholder id; unchecked here


def params(item: MultimodalItemMetadata, delta: int | None = None) -> MultimodalParams:
    return MultimodalParams.from_items([item], mrope_position_delta=delta)


# 10 tokens, blocks [0,4) [4,8) full, [8,10) partial; the image's 2 rows sit at 8..9 only.
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, PAD, PAD]
TAIL = MultimodalItemMetadata(A, ((8, 2),), Modality.IMAGE, grid_thw=(1, 2, 4))
# An item inside the full blocks: rows at 1..4 (two blocks).
MID_TOKENS = [1, PAD, PAD, PAD, PAD, 6, 7, 8, 9, 10]
MID = MultimodalItemMetadata(A, ((1, 4),), Modality.IMAGE, grid_thw=(1, 4, 4))


@pytest.mark.parametrize(
    ("tokens", "one", "other"),
    [
        # other content in the partial block: full-block hashes agree, the KV does not
        (TOKENS, params(TAIL), params(dataclasses.replace(TAIL, content_hash=B))),
        (TOKENS, params(TAIL), params(dataclasses.replace(TAIL, uuid="u"))),
        # fields no block key names
        (MID_TOKENS, params(MID), params(dataclasses.replace(MID, grid_thw=(1, 8, 2)))),
        (MID_TOKENS, params(MID, 0), params(MID, 3)),
        (
            MID_TOKENS,
            params(dataclasses.replace(MID, modality=Modality.VIDEO, frame_timestamps=(0.0,))),
            params(dataclasses.replace(MID, modality=Modality.VIDEO, frame_timestamps=(1.0,))),
        ),
    ],
)
def test_what_no_full_block_hash_covers_changes_the_prompt_digest(tokens, one, other) -> None:
    assert block_hashes(tokens, BS, one) == block_hashes(tokens, BS, other)
    assert prompt_digest(tokens, one) != prompt_digest(tokens, other)


def test_every_run_of_an_item_in_the_partial_block_counts_in_the_prompt_digest() -> None:
    # One video item of 3 rows: its first run at 1 (a full block), the rest in the partial
    # block, split two ways. With only the first run digested every test passed (mutation
    # review, s36).
    tokens = [1, PAD, 3, 4, 5, 6, 7, 8, PAD, PAD]
    one = MultimodalItemMetadata(A, ((1, 1), (8, 2)), Modality.VIDEO)
    other = MultimodalItemMetadata(A, ((1, 1), (8, 1), (9, 1)), Modality.VIDEO)
    assert block_hashes(tokens, BS, params(one)) == block_hashes(tokens, BS, params(other))
    assert prompt_digest(tokens, params(one)) != prompt_digest(tokens, params(other))


def test_salt_and_lora_change_the_prompt_digest_of_a_prompt_shorter_than_a_block() -> None:
    short = [1, 2, 3]
    assert block_hashes(short, BS) == []
    base = prompt_digest(short)
    assert prompt_digest(short, cache_salt="tenant:x") != base
    assert prompt_digest(short, lora_id="a") != base
