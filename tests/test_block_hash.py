"""Contracts of the canonical block hash (DESIGN §3, docs/block-hash.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.hashing import DEFAULT_ROOT, MmKey, block_extra_keys, block_hashes, root_hash
from common.multimodal.params import MultimodalParams, runs_from_mask

ROOT = Path(__file__).resolve().parent.parent
HA, HB = b"\xaa" * 32, b"\xbb" * 32
PAD = 9  # placeholder token id in these tests
BLOCK_SIZES = [1, 4, 16, 64]


def prompt_with_runs(
    runs: list[tuple[int, int]], length: int, item_hash: bytes = HA, uuid: str | None = None
) -> tuple[np.ndarray, MultimodalParams]:
    """A prompt of distinct text tokens with one item placed at `runs`."""
    tokens = np.arange(1000, 1000 + length, dtype=np.int64)
    for start, n in runs:
        tokens[start : start + n] = PAD
    cu = [0, len(runs)]
    params = MultimodalParams.from_flat(
        [item_hash],
        [runs[0][0]],
        [sum(n for _, n in runs)],
        [uuid],
        cu,
        [s for s, _ in runs],
        [n for _, n in runs],
    )
    return tokens, params


def first_difference(a: list[bytes], b: list[bytes]) -> int | None:
    assert len(a) == len(b)
    diffs = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if diffs:
        # once the chain breaks it stays broken
        assert diffs == list(range(diffs[0], len(a)))
        return diffs[0]
    return None


# Shape of the hash list


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_one_hash_per_full_block(block_size: int) -> None:
    tokens = list(range(3 * block_size + block_size // 2))
    hashes = block_hashes(tokens, block_size)
    assert len(hashes) == 3
    assert all(len(h) == 32 for h in hashes)
    assert len(set(hashes)) == 3
    assert block_hashes(tokens[: 3 * block_size], block_size) == hashes


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="int32"):
        block_hashes([1, 2**40], 1)
    with pytest.raises(ValueError, match="integer"):
        block_hashes([1.5, 2.0], 1)  # type: ignore[list-item]


def test_layout_past_prompt_is_an_error() -> None:
    tokens, params = prompt_with_runs([(4, 4), (12, 4)], 16)
    with pytest.raises(ValueError, match="past the prompt"):
        block_hashes(tokens[:15], 4, params)


# Run path equals the legacy path for contiguous items


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=5),
    st.sampled_from(BLOCK_SIZES),
    st.integers(0, 7),
)
@settings(max_examples=150, deadline=None)
def test_run_path_equals_legacy_path(
    gaps_and_lengths: list[tuple[int, int]], block_size: int, tail: int
) -> None:
    positions, lengths, cursor = [], [], 0
    for gap, n in gaps_and_lengths:
        cursor += gap
        positions.append(cursor)
        lengths.append(n)
        cursor += n
    tokens = np.arange(cursor + tail) + 5
    hashes = [bytes([i + 1]) * 32 for i in range(len(lengths))]
    legacy = MultimodalParams.from_flat(hashes, positions, lengths)
    runs = MultimodalParams.from_flat(
        hashes, positions, lengths, None, list(range(len(lengths) + 1)), positions, lengths
    )
    assert block_hashes(tokens, block_size, legacy) == block_hashes(tokens, block_size, runs)
    if positions[0] < (len(tokens) // block_size) * block_size:  # a full block holds a run
        assert block_hashes(tokens, block_size, runs) != block_hashes(tokens, block_size)


# Sensitivity: a change alters that block's hash and every later one, never an earlier one


@pytest.mark.parametrize("block_size", [4, 16])
def test_changes_propagate_forward_only(block_size: int) -> None:
    runs = [(5, 10), (20, 10)]
    tokens, params = prompt_with_runs(runs, 48)
    base = block_hashes(tokens, block_size, params, cache_salt="s", lora_id="l")

    changed = tokens.copy()
    changed[17] += 1  # a gap text token between the runs
    assert first_difference(
        base, block_hashes(changed, block_size, params, cache_salt="s", lora_id="l")
    ) == (17 // block_size)

    _, other_hash = prompt_with_runs(runs, 48, item_hash=HB)
    assert first_difference(
        base, block_hashes(tokens, block_size, other_hash, cache_salt="s", lora_id="l")
    ) == (5 // block_size)

    _, other_uuid = prompt_with_runs(runs, 48, uuid="u")
    assert first_difference(
        base, block_hashes(tokens, block_size, other_uuid, cache_salt="s", lora_id="l")
    ) == (5 // block_size)

    # The same item split into runs differently: the first block whose tokens or offsets
    # differ is the one holding position 13 (text in one layout, a placeholder in the other).
    moved_tokens, moved = prompt_with_runs([(5, 8), (20, 12)], 48)
    assert first_difference(
        base, block_hashes(moved_tokens, block_size, moved, cache_salt="s", lora_id="l")
    ) == (13 // block_size)

    assert (
        first_difference(
            base, block_hashes(tokens, block_size, params, cache_salt="t", lora_id="l")
        )
        == 0
    )
    assert (
        first_difference(
            base, block_hashes(tokens, block_size, params, cache_salt="s", lora_id="m")
        )
        == 0
    )
    assert first_difference(base, block_hashes(tokens, block_size, params, lora_id="l")) == 0


def test_root_separates_models() -> None:
    tokens = list(range(32))
    a = block_hashes(tokens, 16, root=root_hash("model-a", "layout"))
    b = block_hashes(tokens, 16, root=root_hash("model-b", "layout"))
    assert a[0] != b[0] and a[1] != b[1]
    assert block_hashes(tokens, 16) == block_hashes(tokens, 16, root=DEFAULT_ROOT)


def test_same_placeholders_different_media_never_collide() -> None:
    # The seed's collision: same prompt ids, different image content.
    tokens, a = prompt_with_runs([(1, 2)], 5)
    _, b = prompt_with_runs([(1, 2)], 5, item_hash=HB)
    assert block_hashes(tokens, 4, a)[0] != block_hashes(tokens, 4, b)[0]
    assert block_hashes(tokens, 4, a)[0] != block_hashes(tokens, 4)[0]


# Extra keys follow the exact runs


def test_gap_only_block_has_no_key_and_offsets_accumulate() -> None:
    # runs [4, 8) and [16, 24); block [8, 16) holds only gap text
    _, params = prompt_with_runs([(4, 4), (16, 8)], 32)
    assert block_extra_keys(params, 0, 8) == [MmKey(HA, 0, None)]
    assert block_extra_keys(params, 8, 16) == []
    assert block_extra_keys(params, 16, 24) == [MmKey(HA, 4, None)]
    assert block_extra_keys(params, 20, 28) == [MmKey(HA, 8, None)]
    assert block_extra_keys(params, 24, 32) == []


def test_block_spanning_two_runs_gets_both_keys() -> None:
    _, params = prompt_with_runs([(2, 3), (7, 5)], 16)
    assert block_extra_keys(params, 0, 8) == [MmKey(HA, 0, None), MmKey(HA, 3, None)]
    assert block_extra_keys(params, 8, 16) == [MmKey(HA, 4, None)]


def test_two_items_keys_in_prompt_order() -> None:
    params = MultimodalParams.from_flat(
        [HA, HB], [2, 6], [3, 4], ["x", None], [0, 1, 3], [2, 6, 12], [3, 2, 2]
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


def test_seed_qwen3_vl_two_runs() -> None:
    # [10, 890) and [898, 1778), separated by "<vision_end><0.2 seconds><vision_start>"
    tokens, params = prompt_with_runs([(10, 880), (898, 880)], 1800)
    assert block_extra_keys(params, 880, 896) == [MmKey(HA, 870, None)]
    assert block_extra_keys(params, 896, 912) == [MmKey(HA, 880, None)]
    gap_changed = tokens.copy()
    gap_changed[893] += 1
    a, b = block_hashes(tokens, 16, params), block_hashes(gap_changed, 16, params)
    assert first_difference(a, b) == 893 // 16


def test_runs_from_mask_feeds_hashing() -> None:
    tokens, expected = prompt_with_runs([(3, 5), (10, 6)], 24)
    cu, pos, lens = runs_from_mask(tokens == PAD, [11])
    params = MultimodalParams.from_flat([HA], [pos[0]], [11], None, cu, pos, lens)
    assert block_hashes(tokens, 4, params) == block_hashes(tokens, 4, expected)


# Determinism and the documented byte layout


def test_deterministic_across_processes_and_hash_seeds() -> None:
    script = (
        "import numpy as np\n"
        "from common.block_hash import block_hashes\n"
        "from common.multimodal import MultimodalParams\n"
        "p = MultimodalParams.from_flat([b'\\xaa' * 32], [3], [9], ['u'], [0, 3],"
        " [3, 10, 20], [3, 4, 2])\n"
        "print(b''.join(block_hashes(np.arange(40), 8, p, cache_salt='s', lora_id=7)).hex())\n"
    )
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        outputs.add(result.stdout.strip())
    assert len(outputs) == 1
    params = MultimodalParams.from_flat([HA], [3], [9], ["u"], [0, 3], [3, 10, 20], [3, 4, 2])
    local = b"".join(block_hashes(np.arange(40), 8, params, cache_salt="s", lora_id=7)).hex()
    assert outputs == {local}


def test_golden_vectors_in_docs() -> None:
    """The vectors printed in docs/block-hash.md are what this code computes."""
    doc = (ROOT / "docs" / "block-hash.md").read_text()
    params = MultimodalParams.from_flat(
        [bytes(range(32))], [2], [6], ["cat"], [0, 3], [2, 7, 12], [2, 2, 2]
    )
    tokens = list(range(100, 116))
    vectors = {
        "root": DEFAULT_ROOT,
        "text": block_hashes(tokens, 4),
        "salted": block_hashes(tokens, 4, cache_salt="tenant-1", lora_id="adapter-a"),
        "multimodal": block_hashes(tokens, 4, params),
    }
    for name, value in vectors.items():
        values = value if isinstance(value, list) else [value]
        for i, digest in enumerate(values):
            assert digest.hex() in doc, f"golden vector {name}[{i}] missing from the doc"
