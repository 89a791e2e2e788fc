"""Extra keys of the canonical block hash follow the exact runs (DESIGN §3, docs/block-hash.md).

The extra-key rules are checked on the production path: `keys_by_span` (what `block_hashes`
calls) for the keys, and `block_hashes` against the byte layout of docs/block-hash.md packed
from those keys written out by hand: gap-only blocks, blocks spanning runs, several items,
runs past the legacy span and the seed layouts.
"""

from __future__ import annotations

import numpy as np

from common.kv.hashing import MmKey, block_extra_keys, block_hashes, keys_by_span
from common.multimodal.params import MultimodalParams, runs_from_mask
from tests.test_block_hash import (
    HA,
    HB,
    PAD,
    assert_block_keys,
    documented_hashes,
    first_difference,
    prompt_with_runs,
)


def test_gap_only_block_has_no_key_and_offsets_accumulate() -> None:
    # runs [4, 8) and [16, 24); block [8, 16) holds only gap text
    tokens, params = prompt_with_runs([(4, 4), (16, 8)], 32)
    assert_block_keys(tokens, 8, params, {0: [MmKey(HA, 0, None)], 2: [MmKey(HA, 4, None)]})
    assert_block_keys(
        tokens,
        4,
        params,
        {1: [MmKey(HA, 0, None)], 4: [MmKey(HA, 4, None)], 5: [MmKey(HA, 8, None)]},
    )
    assert block_extra_keys(params, 0, 8) == [MmKey(HA, 0, None)]
    assert block_extra_keys(params, 8, 16) == []
    assert block_extra_keys(params, 16, 24) == [MmKey(HA, 4, None)]
    assert block_extra_keys(params, 20, 28) == [MmKey(HA, 8, None)]
    assert block_extra_keys(params, 24, 32) == []


def test_block_spanning_two_runs_gets_both_keys() -> None:
    tokens, params = prompt_with_runs([(2, 3), (7, 5)], 16)
    assert_block_keys(
        tokens, 8, params, {0: [MmKey(HA, 0, None), MmKey(HA, 3, None)], 1: [MmKey(HA, 4, None)]}
    )
    assert block_extra_keys(params, 0, 8) == [MmKey(HA, 0, None), MmKey(HA, 3, None)]
    assert block_extra_keys(params, 8, 16) == [MmKey(HA, 4, None)]


def test_two_items_keys_in_prompt_order() -> None:
    params = MultimodalParams.from_flat(
        [HA, HB], [2, 6], [3, 4], ["x", None], [0, 1, 3], [2, 6, 12], [3, 2, 2]
    )
    tokens = np.arange(16) + 1000
    assert_block_keys(
        tokens, 8, params, {0: [MmKey(HA, 0, "x"), MmKey(HB, 0, None)], 1: [MmKey(HB, 2, None)]}
    )
    assert block_extra_keys(params, 0, 8) == [MmKey(HA, 0, "x"), MmKey(HB, 0, None)]
    assert block_extra_keys(params, 8, 16) == [MmKey(HB, 2, None)]


def test_tail_runs_past_position_plus_length_carry_keys() -> None:
    # 8 frames x 258 rows with 13-token gaps: positions past position + length (the
    # legacy span) still hold placeholders, and their blocks must carry the item key.
    starts = [10 + k * (258 + 13) for k in range(8)]
    tokens, params = prompt_with_runs([(s, 258) for s in starts], starts[-1] + 258 + 20)
    legacy_end = params.items[0].position + params.items[0].length  # 10 + 2064
    assert params.items[0].end > legacy_end  # the last run reaches past the legacy span
    block = (legacy_end // 16 + 1) * 16  # a block wholly past the legacy span
    assert block + 16 <= params.items[0].end
    keys = block_extra_keys(params, block, block + 16)
    assert keys == [MmKey(HA, 7 * 258 + block - starts[-1], None)]
    block_starts = np.arange(len(tokens) // 16, dtype=np.int64) * 16
    by_block = keys_by_span(params, block_starts, block_starts + 16)
    assert by_block[block // 16] == keys  # what block_hashes hashes for that block
    assert block_hashes(tokens, 16, params) == documented_hashes(tokens, 16, by_block)
    # and hashing differs from a prompt that has the legacy span only
    legacy = MultimodalParams.from_flat([HA], [10], [8 * 258])
    assert block_hashes(tokens, 64, params) != block_hashes(tokens, 64, legacy)


def test_seed_evs_pruned_layout() -> None:
    lengths = [1026, 2, 2, 2, 2, 2, 2, 2]
    runs, cursor = [], 30
    for n in lengths:
        runs.append((cursor, n))
        cursor += n + 13
    tokens, params = prompt_with_runs(runs, cursor + 10)
    hashes = block_hashes(tokens, 16, params)
    assert len(hashes) == len(tokens) // 16
    # each tiny run lands in some block's keys with its accumulated offset
    offsets = [1026 + 2 * k for k in range(7)]
    seen = [
        key.offset
        for b in range(len(hashes))
        for key in block_extra_keys(params, 16 * b, 16 * b + 16)
    ]
    for offset in offsets:
        assert offset in seen
    starts = np.arange(len(hashes), dtype=np.int64) * 16
    by_block = keys_by_span(params, starts, starts + 16)
    assert [key.offset for b in sorted(by_block) for key in by_block[b]] == seen
    assert hashes == documented_hashes(tokens, 16, by_block)


def test_seed_qwen3_vl_two_runs() -> None:
    # [10, 890) and [898, 1778), separated by "<vision_end><0.2 seconds><vision_start>"
    tokens, params = prompt_with_runs([(10, 880), (898, 880)], 1800)
    assert block_extra_keys(params, 880, 896) == [MmKey(HA, 870, None)]
    assert block_extra_keys(params, 896, 912) == [MmKey(HA, 880, None)]
    starts = np.arange(1800 // 16, dtype=np.int64) * 16
    by_block = keys_by_span(params, starts, starts + 16)
    assert by_block[55] == [MmKey(HA, 870, None)] and by_block[56] == [MmKey(HA, 880, None)]
    assert block_hashes(tokens, 16, params) == documented_hashes(tokens, 16, by_block)
    gap_changed = tokens.copy()
    gap_changed[893] += 1
    a, b = block_hashes(tokens, 16, params), block_hashes(gap_changed, 16, params)
    assert first_difference(a, b) == 893 // 16


def test_runs_from_mask_feeds_hashing() -> None:
    tokens, expected = prompt_with_runs([(3, 5), (10, 6)], 24)
    cu, pos, lens = runs_from_mask(tokens == PAD, [11])
    params = MultimodalParams.from_flat([HA], [pos[0]], [11], None, cu, pos, lens)
    assert block_hashes(tokens, 4, params) == block_hashes(tokens, 4, expected)
