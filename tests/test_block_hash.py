"""Contracts of the canonical block hash (DESIGN §3, docs/block-hash.md): the shape of the
hash list, the run path against the legacy path, sensitivity to every input, determinism
across processes, and the golden vectors (the same literals as docs/block-hash.md).

The extra-key rules are in test_block_hash_extra_keys.py, which shares the helpers here.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.hashing import (
    DEFAULT_ROOT,
    MmKey,
    block_extra_keys,
    block_hashes,
    keys_by_span,
    root_hash,
)
from common.multimodal.params import (
    ItemPartition,
    Modality,
    MultimodalItemMetadata,
    MultimodalParams,
)

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


def documented_hashes(
    tokens: np.ndarray | list[int],
    block_size: int,
    keys: dict[int, list[MmKey]],
    cache_salt: str | None = None,
    lora_id: str | int | None = None,
) -> list[bytes]:
    """The chain docs/block-hash.md defines, each block packed with `msgpack.packb` from
    `keys` (block index -> extra keys; a block not in it has none)."""
    data = np.asarray(tokens).astype("<i4").tobytes()
    parent, out = DEFAULT_ROOT, []
    for b in range(len(tokens) // block_size):
        block = data[4 * b * block_size : 4 * (b + 1) * block_size]
        salt = cache_salt if b == 0 else None
        packed = msgpack.packb([parent, block, keys.get(b, []), salt, lora_id], use_bin_type=True)
        parent = hashlib.sha256(packed).digest()
        out.append(parent)
    return out


def assert_block_keys(
    tokens: np.ndarray, block_size: int, params: MultimodalParams, keys: dict[int, list[MmKey]]
) -> None:
    """`block_hashes` hashes exactly `keys` for the full blocks of `tokens`."""
    starts = np.arange(len(tokens) // block_size, dtype=np.int64) * block_size
    assert keys_by_span(params, starts, starts + block_size) == keys
    assert block_hashes(tokens, block_size, params) == documented_hashes(tokens, block_size, keys)


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


# Determinism and the documented byte layout


def test_deterministic_across_processes_and_hash_seeds() -> None:
    script = (
        "import numpy as np\n"
        "from common.kv.hashing import block_hashes\n"
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


# Golden vectors: literals here, the same literals in docs/block-hash.md (a cross-language
# contract: a change here is a new scheme, not a fix).
GOLDEN_ROOT = "0fbd438445b1ef12714d95a01392734385e7dedb2b11d4326cfed24602232633"
GOLDEN = {
    "text": [
        "5e26fa5a0f06412fb49ab2a58153f9ede7b89c9487bbbc235e71ec4477ef72c4",
        "b7297910560d90cb9110624fd4f2f5bc887b3b9ae4e8afbdf00e4227a0a9bb54",
        "6ccacc958fa7739fd14069bb258922f36bfa1ef5f030cddc3a285e52b5567b52",
        "f5f59fe820144c12c6c08d44e5451a6373a5f8c166c699803481e2d11fb23f8b",
    ],
    "salted": [
        "91d372ac95b3e861f5bd6da855faf7394f8d36c3f277b9376ac71fbb0a5c517d",
        "bcf523c325ec59553709f55a7c3c7f3636d0945f54d0a3b7c35af4bf442ceb2b",
        "170d1139abf9742ecb4f3f596f5c20cefa8373ea4be0144fc7cd15184203a64c",
        "79bb6a0e9887f76d1e54b64795c1cf41ddec9888f6622e16fb099761bef7de78",
    ],
    "multimodal": [
        "1a588ccae039b5c0f93102f7ca34af2bf1e868bedabe43ba7d39d7c3fcd898a7",
        "90408d4d04fdb732fe3a4891e0659d9236230753528ba1e4c7190b5fc1d00a0a",
        "24de66e31eac6e963cb3be80adbeba05750937d518ca35976815bb59d5682de8",
        "fa1a6f9420a640871599e8bd1039da8838e463ed08c2a0fd64a420aea64129f3",
    ],
    "partitioned": [
        "0d96e787133560844f80d0b351e849b56ef0c336eb11494640f356656eb0ea7d",
        "3039f51392aaacf01131cbd8941cfe01fd642e32da1f6eb2eb7e162f289a06b9",
        "e061ba6171d41adf5e9a231eafebbe1605738406b3dcb3d76956f68539a799de",
        "d028b40f9da483bc3864aacc3d3f222a349bdad8d8a1fa17bd1db40a50fcf7f8",
    ],
}


def golden_partitioned(partition_keys: bool = True) -> MultimodalParams:
    """The doc's partitioned example: the multimodal item with partitions of 1, 3, 2 rows."""
    parts = tuple(
        ItemPartition(start, end, rows, bytes(range(32 * k, 32 * k + 32)))
        for k, (start, end, rows) in enumerate([(0, 4, 1), (4, 16, 3), (16, 24, 2)], start=1)
    )
    item = MultimodalItemMetadata(
        bytes(range(32)),
        ((2, 2), (7, 2), (12, 2)),
        Modality.VIDEO,
        uuid="cat",
        partitions=parts,
        partition_keys=partition_keys,
    )
    return MultimodalParams.from_items([item])


def test_golden_vectors() -> None:
    """The code computes the literal vectors; the multimodal one from the documented keys."""
    item = bytes(range(32))
    params = MultimodalParams.from_flat([item], [2], [6], ["cat"], [0, 3], [2, 7, 12], [2, 2, 2])
    tokens = list(range(100, 116))
    assert DEFAULT_ROOT.hex() == GOLDEN_ROOT
    assert [h.hex() for h in block_hashes(tokens, 4)] == GOLDEN["text"]
    salted = block_hashes(tokens, 4, cache_salt="tenant-1", lora_id="adapter-a")
    assert [h.hex() for h in salted] == GOLDEN["salted"]
    assert [h.hex() for h in block_hashes(tokens, 4, params)] == GOLDEN["multimodal"]
    # the per-block keys the doc lists: [(h, 0)], [(h, 2)], [(h, 3)], [(h, 4)], uuid "cat"
    keys = {b: [MmKey(item, offset, "cat")] for b, offset in enumerate([0, 2, 3, 4])}
    assert keys_by_span(params, np.arange(4) * 4, np.arange(1, 5) * 4) == keys
    assert [h.hex() for h in documented_hashes(tokens, 4, keys)] == GOLDEN["multimodal"]


def test_golden_partitioned_vectors() -> None:
    """Partition keys: the doc's per-block keys and vectors; without the flag the same
    item hashes like the plain multimodal example."""
    params = golden_partitioned()
    tokens = list(range(100, 116))
    p0, p1, p2 = (part.content_hash for part in params.items[0].partitions)
    keys = {
        0: [MmKey(p0, 0, "cat"), MmKey(p1, 0, "cat")],
        1: [MmKey(p1, 1, "cat")],
        2: [MmKey(p1, 2, "cat")],
        3: [MmKey(p2, 0, "cat")],
    }
    assert keys_by_span(params, np.arange(4) * 4, np.arange(1, 5) * 4) == keys
    assert [h.hex() for h in block_hashes(tokens, 4, params)] == GOLDEN["partitioned"]
    assert [h.hex() for h in documented_hashes(tokens, 4, keys)] == GOLDEN["partitioned"]
    assert block_extra_keys(params, 1, 5) == [MmKey(p0, 0, "cat"), MmKey(p1, 0, "cat")]
    assert block_extra_keys(params, 8, 13) == [MmKey(p1, 2, "cat"), MmKey(p2, 0, "cat")]
    off = block_hashes(tokens, 4, golden_partitioned(partition_keys=False))
    assert [h.hex() for h in off] == GOLDEN["multimodal"]


def test_golden_vectors_in_docs() -> None:
    """The vectors printed in docs/block-hash.md are the literals above."""
    doc = (ROOT / "docs" / "block-hash.md").read_text()
    assert GOLDEN_ROOT in doc, "golden root missing from the doc"
    for name, values in GOLDEN.items():
        block = "\n".join(values)
        assert block in doc, f"golden vectors {name} missing from the doc (or out of order)"
