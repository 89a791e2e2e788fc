"""Block hashing against its documentation read literally, on generated inputs: the
pre-packed chain equals `msgpack.packb` of each block's list, and the array computation of
extra keys (`keys_by_span`) equals docs/block-hash.md's per-item, per-run, per-partition
rule."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.hashing import MmKey, block_hashes, keys_by_span
from common.multimodal.params import (
    ItemPartition,
    Modality,
    MultimodalItemMetadata,
    MultimodalParams,
)
from tests.test_block_hash import documented_hashes


@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300),
    st.sampled_from([1, 3, 16, 64, 70]),  # 64 and 70: token bytes past bin8
    st.one_of(st.none(), st.text(max_size=40)),
    st.one_of(st.none(), st.text(max_size=5), st.integers(0, 2**40)),
    st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_text_blocks_equal_the_documented_chain(
    tokens: list[int], block_size: int, salt: str | None, lora: str | int | None, as_array: bool
) -> None:
    """The pre-packed fast path equals `msgpack.packb` of each block's list, for a list of
    ints and for an array, any salt and LoRA id."""
    ids = np.array(tokens, dtype=np.int64) if as_array else tokens
    got = block_hashes(ids, block_size, cache_salt=salt, lora_id=lora)
    assert got == documented_hashes(tokens, block_size, {}, cache_salt=salt, lora_id=lora)


def reference_keys(params: MultimodalParams, start: int, end: int) -> list[MmKey]:
    """docs/block-hash.md's rule for one block, read literally: per item, per run, per
    partition (when the item has partition keys)."""
    keys = []
    for item in params.items:
        placed = 0  # item rows placed by earlier runs
        for rs, n in item.runs:
            if rs < end and rs + n > start:
                r0 = placed + max(start, rs) - rs
                r1 = placed + min(end, rs + n) - rs
                if not item.partition_keys:
                    keys.append(MmKey(item.content_hash, r0, item.uuid))
                else:
                    p0 = 0
                    for part in item.partitions:
                        if p0 < r1 and p0 + part.output_rows > r0:
                            keys.append(MmKey(part.content_hash, max(r0, p0) - p0, item.uuid))
                        p0 += part.output_rows
            placed += n
    return keys


@st.composite
def layouts(draw: st.DrawFn) -> tuple[MultimodalParams, int]:
    """Items in prompt order, each a few runs with text gaps; some with partition keys."""
    items, cursor = [], draw(st.integers(0, 6))
    for i in range(draw(st.integers(1, 3))):
        runs = []
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.integers(1, 12))
            runs.append((cursor, n))
            cursor += n + draw(st.integers(0, 5))
        rows = sum(n for _, n in runs)
        keyed = draw(st.booleans())
        parts: tuple[ItemPartition, ...] = ()
        if keyed:
            cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=4))) if rows > 1 else []
            bounds = [0, *cuts, rows]
            parts = tuple(
                ItemPartition(a, b, b - a, bytes([i, k]) * 16)
                for k, (a, b) in enumerate(itertools.pairwise(bounds))
            )
        uuid = draw(st.one_of(st.none(), st.just(f"u{i}")))
        items.append(
            MultimodalItemMetadata(
                bytes([0xA0 + i]) * 32,
                tuple(runs),
                Modality.VIDEO,
                uuid=uuid,
                partitions=parts,
                partition_keys=keyed,
            )
        )
    return MultimodalParams.from_items(items), cursor + draw(st.integers(0, 9))


@given(layouts(), st.sampled_from([1, 3, 4, 16]))
@settings(max_examples=200, deadline=None)
def test_keys_by_span_follows_the_documented_rule(
    layout: tuple[MultimodalParams, int], block_size: int
) -> None:
    """`keys_by_span` equals the rule read literally, for any mix of
    items with and without partition keys, runs split by text, and block sizes."""
    params, num_tokens = layout
    starts = np.arange(num_tokens // block_size, dtype=np.int64) * block_size
    expected = {
        b: keys
        for b, s in enumerate(starts.tolist())
        if (keys := reference_keys(params, s, s + block_size))
    }
    assert keys_by_span(params, starts, starts + block_size) == expected
    tokens = np.arange(num_tokens) + 5
    assert block_hashes(tokens, block_size, params) == documented_hashes(
        tokens, block_size, expected
    )


def test_partition_keys_without_partitions_that_make_the_rows_hash_nothing() -> None:
    # Built without validation (every entry point validates), its placeholders got no key
    # at all: hashed as the text they stand in for, as another image's would be.
    import dataclasses

    import pytest

    item = MultimodalItemMetadata(content_hash=b"h" * 32, runs=((2, 4),), partition_keys=True)
    params = MultimodalParams((item,), {}, 0)
    with pytest.raises(ValueError, match="partitions"):
        block_hashes(list(range(8)), 4, params)
    half = ItemPartition(0, 4, 2, b"p" * 32)
    short = dataclasses.replace(item, partitions=(half,))  # 2 rows of 4
    with pytest.raises(ValueError, match="partitions"):
        block_hashes(list(range(8)), 4, MultimodalParams((short,), {}, 0))
