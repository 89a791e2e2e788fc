"""Contracts of MultimodalParams: validation of the flat wire arrays and runs_from_mask."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import FieldError
from common.multimodal.params import (
    ItemPartition,
    Modality,
    MultimodalItemMetadata,
    MultimodalParams,
    runs_from_mask,
)
from common.multimodal.validation import INT32_MAX, MultimodalLayoutError

H0, H1, H2 = (bytes([i]) * 32 for i in range(3))


def two_items(**overrides: object) -> dict[str, object]:
    """A valid two-item layout: item 0 runs [2,5) + [8,10), item 1 runs [10,14)."""
    fields: dict[str, object] = {
        "hashes": [H0, H1],
        "positions": [2, 10],
        "lengths": [5, 4],
        "uuids": ["a", None],
        "item_run_cu_offsets": [0, 2, 3],
        "run_positions": [2, 8, 10],
        "run_lengths": [3, 2, 4],
    }
    fields.update(overrides)
    return fields


def test_valid_runs_build_items() -> None:
    params = MultimodalParams.from_flat(**two_items())  # type: ignore[arg-type]
    assert params.items[0].runs == ((2, 3), (8, 2))
    assert params.items[1].runs == ((10, 4),)
    assert params.items[0].uuid == "a" and params.items[1].uuid is None
    assert params.lengths == [5, 4] and params.positions == [2, 10]
    assert params.run_items.tolist() == [0, 0, 1]


def test_legacy_fields_give_contiguous_runs() -> None:
    params = MultimodalParams.from_flat([H0, H1], [1, 9], [4, 2])
    assert [item.runs for item in params.items] == [((1, 4),), ((9, 2),)]
    assert params.item_run_cu_offsets.tolist() == [0, 1, 2]


def test_numpy_inputs_accepted() -> None:
    fields = two_items()
    for name in ("positions", "lengths", "item_run_cu_offsets", "run_positions", "run_lengths"):
        fields[name] = np.asarray(fields[name], dtype=np.int32)
    params = MultimodalParams.from_flat(**fields)  # type: ignore[arg-type]
    assert params.items[0].runs == ((2, 3), (8, 2))


@pytest.mark.parametrize(
    ("overrides", "field", "item"),
    [
        # all-or-nothing run fields
        ({"run_lengths": None}, "run_lengths", None),
        ({"run_positions": None, "run_lengths": None}, "run_positions", None),
        ({"item_run_cu_offsets": None}, "item_run_cu_offsets", None),
        # cu offsets: size, start, monotonic, last
        ({"item_run_cu_offsets": [0, 2]}, "item_run_cu_offsets", None),
        ({"item_run_cu_offsets": [1, 2, 3]}, "item_run_cu_offsets", None),
        ({"item_run_cu_offsets": [0, 3, 2]}, "item_run_cu_offsets", 1),
        ({"item_run_cu_offsets": [0, 1, 2]}, "item_run_cu_offsets", None),
        # run lengths sum to the item length
        ({"run_lengths": [3, 1, 4]}, "run_lengths", 0),
        ({"lengths": [5, 5], "run_lengths": [3, 2, 4]}, "run_lengths", 1),
        # ordered and non-overlapping within an item
        ({"run_positions": [2, 4, 10]}, "run_positions", 0),
        ({"run_positions": [8, 2, 10], "positions": [8, 10]}, "run_positions", 0),
        # ... and across items
        ({"run_positions": [2, 8, 9], "positions": [2, 9]}, "run_positions", 1),
        # zero-length run
        ({"run_lengths": [5, 0, 4]}, "run_lengths", 0),
        # int32 limits
        (
            {"run_positions": [2, 8, INT32_MAX - 1], "positions": [2, INT32_MAX - 1]},
            "mm_lengths",
            1,
        ),
        ({"run_positions": [2, 8, 2**31], "positions": [2, 2**31]}, "mm_positions", None),
        ({"lengths": [5, -4]}, "mm_lengths", None),
        # array lengths agree
        ({"positions": [2]}, "mm_positions", None),
        ({"lengths": [5, 4, 1]}, "mm_lengths", None),
        ({"uuids": ["a"]}, "mm_uuids", None),
        ({"hashes": [H0]}, "mm_positions", None),
        # hash size, uuid form
        ({"hashes": [H0, b"short"]}, "mm_hashes", 1),
        ({"uuids": ["a", ""]}, "mm_uuids", 1),
        ({"uuids": ["a", "u" * 257]}, "mm_uuids", 1),  # every block key hashes it
        # position must be the first run's start: after it, or before it (that case
        # unpinned, mutation review, s36)
        ({"positions": [3, 10]}, "mm_positions", 0),
        ({"positions": [1, 10]}, "mm_positions", 0),
        # non-integer values
        ({"run_positions": [2.0, 8.0, 10.0]}, "run_positions", None),
    ],
)
def test_malformed_layout_names_field_and_item(
    overrides: dict[str, object], field: str, item: int | None
) -> None:
    with pytest.raises(MultimodalLayoutError) as info:
        MultimodalParams.from_flat(**two_items(**overrides))  # type: ignore[arg-type]
    assert info.value.field == field, str(info.value)
    assert info.value.item == item, str(info.value)
    assert field in str(info.value)
    if item is not None:
        assert f"item {item}" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, FieldError)  # the servers send its field as epd-field


def test_run_end_overflow_rejected() -> None:
    with pytest.raises(MultimodalLayoutError) as info:
        MultimodalParams.from_flat([H0], [2], [5], None, [0, 2], [2, INT32_MAX - 1], [3, 2])
    assert (info.value.field, info.value.item) == ("run_lengths", 0)


def test_legacy_overlap_rejected() -> None:
    with pytest.raises(MultimodalLayoutError, match="mm_positions"):
        MultimodalParams.from_flat([H0, H1], [0, 3], [4, 4])


def test_check_fits_rejects_run_past_prompt() -> None:
    params = MultimodalParams.from_flat(**two_items())  # type: ignore[arg-type]
    params.check_fits(14)
    with pytest.raises(MultimodalLayoutError, match="past the prompt"):
        params.check_fits(13)


def test_placeholder_mask_matches_runs() -> None:
    params = MultimodalParams.from_flat(**two_items())  # type: ignore[arg-type]
    mask = params.placeholder_mask(16)
    assert np.flatnonzero(mask).tolist() == [2, 3, 4, 8, 9, 10, 11, 12, 13]


def test_check_placeholders() -> None:
    params = MultimodalParams.from_flat(**two_items())  # type: ignore[arg-type]
    tokens = np.array([1, 1, 7, 7, 7, 1, 1, 1, 7, 7, 8, 8, 8, 8, 1])
    params.check_placeholders(tokens, {7, 8})
    stray = tokens.copy()
    stray[6] = 7  # a placeholder id in the gap text
    with pytest.raises(MultimodalLayoutError, match="token 6"):
        params.check_placeholders(stray, {7, 8})
    missing = tokens.copy()
    missing[3] = 1  # a run position holding text
    with pytest.raises(MultimodalLayoutError, match="token 3"):
        params.check_placeholders(missing, {7, 8})


def test_each_item_holds_its_own_modalitys_placeholder() -> None:
    # Either id was taken at any run: an image's run of video placeholders (design review).
    image = MultimodalItemMetadata(H0, ((2, 3), (8, 2)), modality=Modality.IMAGE)
    video = MultimodalItemMetadata(H1, ((10, 4),), modality=Modality.VIDEO)
    params = MultimodalParams.from_items([image, video])
    ids = {Modality.IMAGE: 7, Modality.VIDEO: 8}
    tokens = np.array([1, 1, 7, 7, 7, 1, 1, 1, 7, 7, 8, 8, 8, 8, 1])
    params.check_placeholders(tokens, {7, 8}, ids)
    swapped = tokens.copy()
    swapped[9] = 8  # the image's second run ends in a video placeholder
    params.check_placeholders(swapped, {7, 8})  # without the modalities: taken
    with pytest.raises(MultimodalLayoutError, match=r"token 9 .* item 0's run .* image"):
        params.check_placeholders(swapped, {7, 8}, ids)
    legacy = MultimodalParams.from_items([MultimodalItemMetadata(H0, ((2, 3), (8, 2)))])
    legacy.check_placeholders(np.array([1, 1, 8, 8, 8, 1, 1, 1, 8, 8]), {7, 8}, ids)  # unsaid


def test_from_items_validates() -> None:
    bad = MultimodalItemMetadata(content_hash=H0, runs=((5, 2), (4, 1)))
    with pytest.raises(MultimodalLayoutError, match="run_positions"):
        MultimodalParams.from_items([bad])


# runs_from_mask


@pytest.mark.parametrize(
    ("parts", "flag", "field", "message"),
    [
        ((), True, "items.partition_keys", "without partitions"),
        (((0, 4, 2, H1), (4, 8, 2, b"short")), True, "items.partitions", "32 bytes"),
        (((0, 4, 2, H1), (5, 8, 2, H1)), False, "items.partitions", "does not follow"),
        (((0, 4, 2, H1), (4, 4, 2, H1)), True, "items.partitions", "is empty"),
        (((0, 4, 4, H1), (4, 8, 0, H1)), True, "items.partitions", ">= 1"),
        (((0, 4, 2, H1), (4, 8, 1, H1)), True, "items.partitions", "sum to 3"),
    ],
)
def test_from_items_validates_partitions(
    parts: tuple[tuple[int, int, int, bytes], ...], flag: bool, field: str, message: str
) -> None:
    item = MultimodalItemMetadata(
        H1,
        ((1, 2), (5, 2)),
        partitions=tuple(ItemPartition(*p) for p in parts),
        partition_keys=flag,
    )
    with pytest.raises(MultimodalLayoutError) as info:
        MultimodalParams.from_items([item])
    assert info.value.field == field and info.value.item == 0
    assert message in str(info.value)


def test_runs_from_mask_touching_items() -> None:
    # two items that touch with no text between them, then a split third item
    mask = np.array([0, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1, 1], dtype=bool)
    cu, pos, lens = runs_from_mask(mask, [2, 3, 3])
    assert cu.tolist() == [0, 1, 2, 4]
    assert pos.tolist() == [1, 3, 8, 10]
    assert lens.tolist() == [2, 3, 1, 2]


def test_runs_from_mask_count_mismatch() -> None:
    with pytest.raises(ValueError, match="placeholder"):
        runs_from_mask([0, 1, 1, 0], [3])
    with pytest.raises(ValueError, match=">= 1"):
        runs_from_mask([0, 1, 1, 0], [2, 0])


def test_runs_from_mask_seed_video_shape() -> None:
    # 8 frames x 258 placeholders, 13 tokens of timestamp text between frames
    mask = np.zeros(10 + 8 * 258 + 7 * 13 + 5, dtype=bool)
    starts = [10 + k * (258 + 13) for k in range(8)]
    for s in starts:
        mask[s : s + 258] = True
    cu, pos, lens = runs_from_mask(mask, [8 * 258])
    assert cu.tolist() == [0, 8]
    assert pos.tolist() == starts
    assert lens.tolist() == [258] * 8


@st.composite
def layouts(draw: st.DrawFn) -> tuple[np.ndarray, list[int]]:
    """A random prompt mask with random item splits of its placeholder tokens."""
    segments = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), min_size=1, max_size=12))
    mask = np.concatenate([np.full(n, flag, dtype=bool) for flag, n in segments])
    total = int(mask.sum())
    if total == 0:
        return mask, []
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=4))) if total > 1 else []
    bounds = [0, *cuts, total]
    return mask, [b - a for a, b in itertools.pairwise(bounds)]


@given(layouts())
@settings(max_examples=200, deadline=None)
def test_runs_from_mask_property(layout: tuple[np.ndarray, list[int]]) -> None:
    mask, lengths = layout
    cu, pos, lens = runs_from_mask(mask, lengths)
    # Runs cover exactly the mask, each item gets its length, and the result validates.
    covered = np.zeros_like(mask)
    for p, n in zip(pos, lens, strict=True):
        assert not covered[p : p + n].any()
        covered[p : p + n] = True
    assert (covered == mask).all()
    assert [int(lens[a:b].sum()) for a, b in itertools.pairwise(cu)] == lengths
    if lengths:
        params = MultimodalParams.from_flat(
            [H0] * len(lengths), pos[cu[:-1]], lengths, None, cu, pos, lens
        )
        assert params.lengths == lengths
        assert (params.placeholder_mask(len(mask)) == mask).all()


def test_partition_keys_are_a_videos_only() -> None:
    # An image (or an item whose sender named no modality) keyed by its partitions: the
    # rule is written for videos, whose partitions the tower encodes apart.
    from common.multimodal.params import Modality

    parts = (ItemPartition(0, 4, 2, H1), ItemPartition(4, 8, 2, H1))
    for modality in (None, Modality.IMAGE):
        item = MultimodalItemMetadata(
            H1, ((1, 2), (5, 2)), modality=modality, partitions=parts, partition_keys=True
        )
        with pytest.raises(MultimodalLayoutError, match="not a video") as info:
            MultimodalParams.from_items([item])
        assert info.value.field == "items.partition_keys"
    video = MultimodalItemMetadata(
        H1, ((1, 2), (5, 2)), modality=Modality.VIDEO, partitions=parts, partition_keys=True
    )
    assert MultimodalParams.from_items([video]).items == (video,)
