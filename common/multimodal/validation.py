"""Validation of the flat multimodal wire arrays (DESIGN §2).

Every boundary that accepts `hashes / positions / lengths / uuids` plus the run extension
goes through `validate_flat`; the first problem found raises `MultimodalLayoutError`
naming the wire field and the item, before anything is cached.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from common.errors import FieldError

INT32_MAX = 2**31 - 1
HASH_BYTES = 32

IntArray = npt.NDArray[np.int64]
IntSequence = Sequence[int] | npt.NDArray[np.integer[Any]]


class MultimodalLayoutError(FieldError):
    """A malformed multimodal layout. `field` names the offending wire field."""

    def __init__(self, field: str, message: str, item: int | None = None) -> None:
        self.item = item  # index of the offending item in prompt order, when one is to blame
        super().__init__(field, message)  # field: wire field name, e.g. "run_lengths"

    @property
    def where(self) -> str:
        """The field, and the item when one is to blame: "run_lengths (item 1)"."""
        return self.field if self.item is None else f"{self.field} (item {self.item})"


# Longest caller-supplied item identity: every block key of the item hashes it (router,
# prefill and decode alike), so its length multiplies the cost of hashing the prompt.
MAX_UUID_CHARS = 256


def validate_flat(
    hashes: Sequence[bytes],
    positions: IntSequence,
    lengths: IntSequence,
    uuids: Sequence[str | None] | None,
    item_run_cu_offsets: IntSequence | None,
    run_positions: IntSequence | None,
    run_lengths: IntSequence | None,
) -> list[tuple[tuple[int, int], ...]]:
    """Validate the flat wire arrays; return each item's runs.

    Raises `MultimodalLayoutError` for the first problem found, naming field and item.
    """
    n = len(hashes)
    pos = _int_array("mm_positions", positions)
    lens = _int_array("mm_lengths", lengths)
    for name, arr in (("mm_positions", pos), ("mm_lengths", lens)):
        if len(arr) != n:
            raise MultimodalLayoutError(name, f"has {len(arr)} entries, mm_hashes has {n}")
    if uuids is not None and len(uuids) != n:
        raise MultimodalLayoutError("mm_uuids", f"has {len(uuids)} entries, mm_hashes has {n}")
    for i, digest in enumerate(hashes):
        if not isinstance(digest, bytes | bytearray) or len(digest) != HASH_BYTES:
            raise MultimodalLayoutError("mm_hashes", f"must be {HASH_BYTES} bytes", i)
    for i, uuid in enumerate(uuids or ()):
        if uuid is None:
            continue
        if not isinstance(uuid, str) or not uuid:
            raise MultimodalLayoutError("mm_uuids", "must be a non-empty string or None", i)
        if len(uuid) > MAX_UUID_CHARS:
            raise MultimodalLayoutError("mm_uuids", f"is over {MAX_UUID_CHARS} characters", i)
    run_fields = {
        "item_run_cu_offsets": item_run_cu_offsets,
        "run_positions": run_positions,
        "run_lengths": run_lengths,
    }
    given = [name for name, value in run_fields.items() if value is not None]
    if not given:
        _check_spans("mm_positions", "mm_lengths", pos, lens, items=None)
        return [((int(p), int(length)),) for p, length in zip(pos, lens, strict=True)]
    # With runs, [position, position + length) is no span (items may have gaps), so the
    # legacy arrays are only checked for range; the runs carry the ordering checks.
    _check_spans("mm_positions", "mm_lengths", pos, lens, items=None, ordered=False)
    if len(given) != len(run_fields):
        missing = [name for name in run_fields if name not in given]
        raise MultimodalLayoutError(
            missing[0], f"run fields must be given together; have {', '.join(given)}"
        )
    assert item_run_cu_offsets is not None and run_positions is not None
    assert run_lengths is not None
    cu = _int_array("item_run_cu_offsets", item_run_cu_offsets)
    rpos = _int_array("run_positions", run_positions)
    rlen = _int_array("run_lengths", run_lengths)
    if len(cu) != n + 1:
        raise MultimodalLayoutError(
            "item_run_cu_offsets", f"has {len(cu)} entries, expected items + 1 = {n + 1}"
        )
    if cu[0] != 0:
        raise MultimodalLayoutError("item_run_cu_offsets", f"must start at 0, got {cu[0]}")
    drops = np.flatnonzero(np.diff(cu) < 0)
    if drops.size:
        i = int(drops[0])
        raise MultimodalLayoutError("item_run_cu_offsets", "must be non-decreasing", i)
    if len(rlen) != len(rpos):
        raise MultimodalLayoutError(
            "run_lengths", f"has {len(rlen)} entries, run_positions has {len(rpos)}"
        )
    if cu[-1] != len(rpos):
        raise MultimodalLayoutError(
            "item_run_cu_offsets", f"last entry {cu[-1]} != run count {len(rpos)}"
        )
    run_items = np.repeat(np.arange(n), np.diff(cu))
    _check_spans("run_positions", "run_lengths", rpos, rlen, items=run_items)
    placed = np.concatenate(([0], np.cumsum(rlen)))
    sums = placed[cu[1:]] - placed[cu[:-1]]
    bad = np.flatnonzero(sums != lens)
    if bad.size:
        i = int(bad[0])
        raise MultimodalLayoutError(
            "run_lengths", f"runs sum to {sums[i]}, expected mm_lengths = {lens[i]}", i
        )
    firsts = rpos[cu[:-1]]
    moved = np.flatnonzero(firsts != pos)
    if moved.size:
        i = int(moved[0])
        raise MultimodalLayoutError(
            "mm_positions", f"{pos[i]} is not the start of the item's first run ({firsts[i]})", i
        )
    return [
        tuple((int(s), int(length)) for s, length in zip(rpos[a:b], rlen[a:b], strict=True))
        for a, b in itertools.pairwise(cu)
    ]


def validate_partitions(
    item: int,
    partitions: Sequence[tuple[int, int, int, bytes]],
    rows: int,
    *,
    partition_keys: bool,
    grid: tuple[int, int, int] | None = None,
    video: bool = False,
) -> None:
    """Check one item's partitions `(input_start, input_end, output_rows, content_hash)`
    against its `rows` (the sum of its run lengths), its `partition_keys` flag and its patch
    `grid` (t, h, w), when it has one.

    Partitions, when given, cover the input in order without gaps (each starts where the
    previous ended), each makes at least one row, their rows sum to the item's and each
    hash is 32 bytes; with a grid they cover exactly its `t * h * w` patch rows from 0, each
    a whole number of frames (`h * w` rows) making its share of the item's rows.
    `partition_keys` needs partitions and a `video` item: block keys then name them
    (docs/block-hash.md), so a partition's hash and rows must be as sound as an item's.
    Raises `MultimodalLayoutError` naming `items.partitions` or `items.partition_keys`.
    """
    if partition_keys and not partitions:
        raise MultimodalLayoutError(
            "items.partition_keys", "set on an item without partitions", item
        )
    if not partitions:
        return
    cursor = partitions[0][0]
    total = 0
    patches = 0 if grid is None else grid[0] * grid[1] * grid[2]  # the item's input rows
    for k, (start, end, out_rows, digest) in enumerate(partitions):
        if start != cursor or end <= start:
            raise MultimodalLayoutError(
                "items.partitions",
                f"partition {k}: input [{start}, {end}) does not follow "
                f"the previous one (ending at {cursor}) or is empty",
                item,
            )
        if out_rows < 1:
            raise MultimodalLayoutError(
                "items.partitions", f"partition {k}: output_rows {out_rows} must be >= 1", item
            )
        if len(digest) != HASH_BYTES:
            raise MultimodalLayoutError(
                "items.partitions",
                f"partition {k}: content_hash must be {HASH_BYTES} bytes, got {len(digest)}",
                item,
            )
        if grid is not None and end % (grid[1] * grid[2]):
            raise MultimodalLayoutError(
                "items.partitions",
                f"partition {k}: input end {end} is not on a frame of the grid {list(grid)}",
                item,
            )
        if grid is not None and out_rows * patches != (end - start) * rows:
            # Each partition's rows are its share of the item's, as its inputs are: a row
            # count moved between partitions would key their hashes to each other's rows.
            raise MultimodalLayoutError(
                "items.partitions",
                f"partition {k}: {out_rows} output rows for {end - start} of the grid's "
                f"{patches} input rows (the item has {rows})",
                item,
            )
        cursor = end
        total += out_rows
    if grid is not None and (partitions[0][0] != 0 or cursor != patches):
        raise MultimodalLayoutError(
            "items.partitions",
            f"inputs [{partitions[0][0]}, {cursor}) are not the grid {list(grid)}'s "
            f"{patches} patch rows",
            item,
        )
    if total != rows:
        raise MultimodalLayoutError(
            "items.partitions", f"output rows sum to {total}, the item has {rows} rows", item
        )
    if partition_keys and not video:  # docs/block-hash.md: the rule holds for videos only
        raise MultimodalLayoutError("items.partition_keys", "set on an item not a video", item)


def _int_array(name: str, values: IntSequence) -> IntArray:
    """Convert to int64, rejecting non-integers and values outside int32."""
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError) as exc:
        raise MultimodalLayoutError(name, f"not an integer array ({exc})") from None
    if arr.ndim != 1:
        raise MultimodalLayoutError(name, f"must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == object:
        if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in arr):
            raise MultimodalLayoutError(name, "must hold integers")
        if any(not -INT32_MAX - 1 <= int(v) <= INT32_MAX for v in arr):
            raise MultimodalLayoutError(name, "value does not fit in int32")
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise MultimodalLayoutError(name, f"must hold integers, got {arr.dtype}")
    out_of_range = np.flatnonzero((arr < 0) | (arr > INT32_MAX))
    if out_of_range.size:
        i = int(out_of_range[0])
        raise MultimodalLayoutError(name, f"entry {i} = {arr[i]} is not in [0, int32 max]")
    return arr.astype(np.int64)


def _check_spans(
    pos_name: str,
    len_name: str,
    pos: IntArray,
    lens: IntArray,
    items: IntArray | None,
    ordered: bool = True,
) -> None:
    """Spans must have length >= 1, end within int32, and (if `ordered`) be in order
    without overlap."""

    def owner(k: int) -> int:
        return k if items is None else int(items[k])

    empty = np.flatnonzero(lens < 1)
    if empty.size:
        k = int(empty[0])
        raise MultimodalLayoutError(len_name, f"length {lens[k]} must be >= 1", owner(k))
    ends = pos + lens
    overflow = np.flatnonzero(ends > INT32_MAX)
    if overflow.size:
        k = int(overflow[0])
        raise MultimodalLayoutError(len_name, "position + length overflows int32", owner(k))
    if not ordered:
        return
    overlap = np.flatnonzero(pos[1:] < ends[:-1])
    if overlap.size:
        k = int(overlap[0]) + 1
        raise MultimodalLayoutError(
            pos_name,
            f"span starting at {pos[k]} overlaps or precedes the previous one ending at "
            f"{ends[k - 1]} (spans must be in prompt order and disjoint)",
            owner(k),
        )
