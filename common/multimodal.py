"""Multimodal item metadata: the one description of where each item sits in a prompt.

`MultimodalItemMetadata` is one record per item in prompt order (DESIGN §2). Its `runs`
give the exact placement: a list of `(prompt_start, length)` spans, ordered and
non-overlapping. `MultimodalParams` holds the items plus, once encoded, their embeddings.

The wire form (`epd.v1.MultimodalParams`) carries the legacy flat arrays (hashes, positions,
lengths, uuids) plus the run extension (`item_run_cu_offsets`, `run_positions`,
`run_lengths`). `MultimodalParams.from_flat` builds and validates from those arrays; every
boundary that accepts them goes through it, so a malformed layout is rejected with a
`MultimodalLayoutError` naming the field and item before any cache sees it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

    from epd.v1 import multimodal_pb2

INT32_MAX = 2**31 - 1
HASH_BYTES = 32

IntArray = npt.NDArray[np.int64]
IntSequence = Sequence[int] | npt.NDArray[np.integer[Any]]


class MultimodalLayoutError(ValueError):
    """A malformed multimodal layout. `field` names the offending wire field."""

    def __init__(self, field: str, message: str, item: int | None = None) -> None:
        where = f"{field}" if item is None else f"{field} (item {item})"
        super().__init__(f"{where}: {message}")
        self.field = field  # wire field name, e.g. "run_lengths"
        self.item = item  # index of the offending item in prompt order, when one is to blame


class Modality(enum.StrEnum):
    """Kind of media an item carries."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


@dataclass(frozen=True, slots=True)
class ItemPartition:
    """An independently encodable part of an item (a video temporal patch, for example)."""

    input_start: int  # first encoder-input row (patch row) of the part
    input_end: int  # one past its last input row
    output_rows: int  # embedding rows the encoder makes for it
    content_hash: bytes  # 32-byte hash of the part's preprocessed content and settings


@dataclass(frozen=True, slots=True)
class MultimodalItemMetadata:
    """One multimodal item: identity, exact placement and encoder layout."""

    content_hash: bytes  # 32 bytes over preprocessed content, shape, dtype and settings
    runs: tuple[tuple[int, int], ...]  # (prompt_start, length) spans, ordered, disjoint
    modality: Modality | None = None  # None when the sender did not say (legacy wire)
    payload_index: int = 0  # which payload of its modality the item is
    uuid: str | None = None  # caller-supplied identity, mixed into block keys
    partitions: tuple[ItemPartition, ...] = ()  # independently encodable parts; () = one
    encoder_cost: float | None = None  # estimated encoder cost, None when unknown
    grid_thw: tuple[int, int, int] | None = None  # mRoPE grid, model-specific
    frame_timestamps: tuple[float, ...] = ()  # seconds per temporal patch (video)

    @property
    def position(self) -> int:
        """Prompt index of the item's first placeholder token."""
        return self.runs[0][0]

    @property
    def length(self) -> int:
        """Placeholder tokens of the item = embedding rows the encoder makes."""
        return sum(length for _, length in self.runs)

    @property
    def end(self) -> int:
        """One past the item's last placeholder token."""
        start, length = self.runs[-1]
        return start + length


@dataclass(frozen=True, slots=True)
class ItemEmbedding:
    """Encoder output of one item."""

    rows: torch.Tensor  # (item.length, hidden) main embedding rows, in run order
    deepstack: tuple[torch.Tensor, ...] = ()  # per-layer extra rows, each like `rows`


@dataclass(frozen=True)
class MultimodalParams:
    """The multimodal half of the stage handoff `(prompt_token_ids, MultimodalParams)`.

    Built through `from_flat` (or `from_items`), which validate; the constructor itself does
    not, so only code that already holds validated items should call it.
    """

    items: tuple[MultimodalItemMetadata, ...] = ()  # in prompt order
    embeddings: Mapping[int, ItemEmbedding] = field(default_factory=dict)  # by item index
    mrope_position_delta: int | None = None  # position offset of tokens after the prompt

    @classmethod
    def from_flat(
        cls,
        hashes: Sequence[bytes],
        positions: IntSequence,
        lengths: IntSequence,
        uuids: Sequence[str | None] | None = None,
        item_run_cu_offsets: IntSequence | None = None,
        run_positions: IntSequence | None = None,
        run_lengths: IntSequence | None = None,
    ) -> MultimodalParams:
        """Build from the flat wire arrays, validating them (DESIGN §2).

        Without the run fields each item is the one contiguous run `[position,
        position + length)`. Raises `MultimodalLayoutError` naming the field and item.
        """
        runs = validate_flat(
            hashes, positions, lengths, uuids, item_run_cu_offsets, run_positions, run_lengths
        )
        uuid_list = list(uuids) if uuids is not None else [None] * len(hashes)
        items = tuple(
            MultimodalItemMetadata(content_hash=bytes(h), runs=item_runs, uuid=u)
            for h, item_runs, u in zip(hashes, runs, uuid_list, strict=True)
        )
        return cls(items=items)

    @classmethod
    def from_items(
        cls,
        items: Sequence[MultimodalItemMetadata],
        embeddings: Mapping[int, ItemEmbedding] | None = None,
        mrope_position_delta: int | None = None,
    ) -> MultimodalParams:
        """Build from item records, validating their layout as `from_flat` does."""
        params = cls(tuple(items), dict(embeddings or {}), mrope_position_delta)
        validate_flat(
            params.hashes,
            params.positions,
            params.lengths,
            params.uuids,
            params.item_run_cu_offsets,
            params.run_positions,
            params.run_lengths,
        )
        for index in params.embeddings:
            if not 0 <= index < len(params.items):
                raise MultimodalLayoutError("embeddings", "no such item", index)
        return params

    # Flat views, as on the wire.

    @property
    def hashes(self) -> list[bytes]:
        """Content hash per item."""
        return [item.content_hash for item in self.items]

    @property
    def positions(self) -> list[int]:
        """First placeholder index per item."""
        return [item.position for item in self.items]

    @property
    def lengths(self) -> list[int]:
        """Placeholder count per item."""
        return [item.length for item in self.items]

    @property
    def uuids(self) -> list[str | None]:
        """Caller identity per item."""
        return [item.uuid for item in self.items]

    @cached_property
    def item_run_cu_offsets(self) -> IntArray:
        """Prefix sums of run counts per item (size items + 1)."""
        counts = [len(item.runs) for item in self.items]
        return np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).astype(np.int64)

    @cached_property
    def run_positions(self) -> IntArray:
        """Prompt start of each run, flat across items."""
        return np.array([s for item in self.items for s, _ in item.runs], dtype=np.int64)

    @cached_property
    def run_lengths(self) -> IntArray:
        """Length of each run, flat across items."""
        return np.array([n for item in self.items for _, n in item.runs], dtype=np.int64)

    @cached_property
    def run_items(self) -> IntArray:
        """Item index of each flat run."""
        counts = np.diff(self.item_run_cu_offsets)
        return np.repeat(np.arange(len(self.items), dtype=np.int64), counts)

    @cached_property
    def run_row_offsets(self) -> IntArray:
        """Item-local row index of each run's first token: rows placed by earlier runs."""
        cu = self.item_run_cu_offsets
        lengths = self.run_lengths
        prior = np.cumsum(lengths) - lengths  # rows before each run, across all items
        return prior - prior[cu[:-1]][self.run_items] if len(lengths) else prior

    @property
    def num_items(self) -> int:
        """Items in the prompt."""
        return len(self.items)

    def placeholder_mask(self, num_tokens: int) -> npt.NDArray[np.bool_]:
        """Boolean mask over the prompt marking every placeholder token of every item."""
        self.check_fits(num_tokens)
        delta = np.zeros(num_tokens + 1, dtype=np.int64)
        np.add.at(delta, self.run_positions, 1)
        np.add.at(delta, self.run_positions + self.run_lengths, -1)
        return np.cumsum(delta[:-1]) > 0

    def check_fits(self, num_tokens: int) -> None:
        """Raise `MultimodalLayoutError` unless every run lies inside a prompt this long."""
        ends = self.run_positions + self.run_lengths
        past = np.flatnonzero(ends > num_tokens)
        if past.size:
            run = int(past[0])
            raise MultimodalLayoutError(
                "run_positions",
                f"run [{self.run_positions[run]}, {ends[run]}) ends past the prompt "
                f"of {num_tokens} tokens",
                int(self.run_items[run]),
            )

    def check_placeholders(
        self, token_ids: IntSequence, placeholder_ids: Sequence[int] | set[int]
    ) -> None:
        """Raise `MultimodalLayoutError` unless the prompt's placeholder tokens (ids in
        `placeholder_ids`) sit exactly at the runs' positions.

        Block keys name each run's first row; the token ids pin where runs end. A prompt
        whose placeholder ids and runs disagree could share a block hash with a different
        layout, so workers reject it before hashing.
        """
        tokens = np.asarray(token_ids)
        mask = self.placeholder_mask(len(tokens))
        is_pad = np.isin(tokens, np.fromiter(placeholder_ids, dtype=np.int64))
        wrong = np.flatnonzero(is_pad != mask)
        if wrong.size:
            i = int(wrong[0])
            what = (
                "is a placeholder id outside every run"
                if is_pad[i]
                else "lies in a run but is not a placeholder id"
            )
            raise MultimodalLayoutError(
                "prompt_token_ids", f"token {i} (id {int(tokens[i])}) {what}"
            )

    def to_proto(self) -> multimodal_pb2.MultimodalParams:
        """The `epd.v1.MultimodalParams` wire form (see `common.wire`)."""
        from common.wire import params_to_proto

        return params_to_proto(self)

    @classmethod
    def from_proto(cls, msg: multimodal_pb2.MultimodalParams) -> MultimodalParams:
        """Validate and decode the wire form (see `common.wire`)."""
        from common.wire import params_from_proto

        return params_from_proto(msg)

    def without_embeddings(self) -> MultimodalParams:
        """The same layout with no embeddings attached."""
        return MultimodalParams(self.items, {}, self.mrope_position_delta)


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
        if uuid is not None and (not isinstance(uuid, str) or not uuid):
            raise MultimodalLayoutError("mm_uuids", "must be a non-empty string or None", i)
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


def runs_from_mask(
    mask: npt.ArrayLike, item_lengths: IntSequence
) -> tuple[IntArray, IntArray, IntArray]:
    """Exact runs from a per-token placeholder mask and the item lengths in prompt order.

    Consecutive placeholder tokens are assigned to items by consuming each item's length, so
    two items may touch with no text between them. Returns `(item_run_cu_offsets,
    run_positions, run_lengths)`. Raises `ValueError` if the mask's placeholder count differs
    from the sum of the lengths or a length is below 1.
    """
    flat = np.asarray(mask, dtype=bool).ravel()
    lens = np.asarray(item_lengths, dtype=np.int64).ravel()
    if (lens < 1).any():
        raise ValueError(f"item lengths must be >= 1, got {lens.tolist()}")
    idx = np.flatnonzero(flat)
    if idx.size != int(lens.sum()):
        raise ValueError(
            f"mask has {idx.size} placeholder tokens but item lengths sum to {int(lens.sum())}"
        )
    if idx.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(1, dtype=np.int64), empty, empty
    item_starts = np.concatenate(([0], np.cumsum(lens)[:-1]))  # index into idx
    is_start = np.zeros(idx.size, dtype=bool)
    is_start[0] = True
    is_start[1:] = np.diff(idx) != 1
    is_start[item_starts] = True
    starts = np.flatnonzero(is_start)
    run_lengths = np.diff(np.append(starts, idx.size)).astype(np.int64)
    run_positions = idx[starts].astype(np.int64)
    cu = np.searchsorted(starts, np.append(item_starts, idx.size)).astype(np.int64)
    return cu, run_positions, run_lengths
