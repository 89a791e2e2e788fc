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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from common.multimodal.validation import (
    IntArray,
    IntSequence,
    MultimodalLayoutError,
    validate_flat,
    validate_partitions,
)

if TYPE_CHECKING:
    import torch

    from epd.v1 import multimodal_pb2


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
    partition_keys: bool = False  # block keys name partitions, not the item (needs parts)

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

    def check_partitions(self, index: int) -> None:
        """Raise `MultimodalLayoutError` unless the partitions fit the item and
        `partition_keys` has partitions to name (`validate_partitions`); `index` is the
        item's place in the prompt, for the message."""
        validate_partitions(
            index,
            [(p.input_start, p.input_end, p.output_rows, p.content_hash) for p in self.partitions],
            self.length,
            partition_keys=self.partition_keys,
            grid=self.grid_thw,
            video=self.modality is Modality.VIDEO,
        )


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
        for index, item in enumerate(params.items):
            item.check_partitions(index)
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

    def placeholder_mask(self, num_tokens: int) -> npt.NDArray[np.bool_]:
        """Boolean mask over the prompt marking every placeholder token of every item."""
        self.check_fits(num_tokens)
        delta = np.zeros(num_tokens + 1, dtype=np.int64)
        np.add.at(delta, self.run_positions, 1)
        np.add.at(delta, self.run_positions + self.run_lengths, -1)
        return np.cumsum(delta[:-1]) > 0

    def check_fits(self, num_tokens: int) -> None:
        """Raise `MultimodalLayoutError` unless every run lies inside a prompt this long."""
        for index, item in enumerate(self.items):  # runs are ordered: the last ends last
            if item.runs and item.end > num_tokens:
                start, length = next((s, n) for s, n in item.runs if s + n > num_tokens)
                raise MultimodalLayoutError(
                    "run_positions",
                    f"run [{start}, {start + length}) ends past the prompt of {num_tokens} tokens",
                    index,
                )

    def check_placeholders(
        self,
        token_ids: IntSequence,
        placeholder_ids: Sequence[int] | set[int],
        by_modality: Mapping[Modality, int] | None = None,
    ) -> None:
        """Raise `MultimodalLayoutError` unless the prompt's placeholder tokens (ids in
        `placeholder_ids`) sit exactly at the runs' positions, and, with `by_modality`, each
        item that names its modality holds that modality's id (an image's run of video
        placeholders was taken).

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
        for index, item in enumerate(self.items):
            wanted = by_modality.get(item.modality) if by_modality and item.modality else None
            for start, length in item.runs if wanted is not None else ():
                odd = np.flatnonzero(tokens[start : start + length] != wanted)
                if odd.size:
                    i = start + int(odd[0])
                    raise MultimodalLayoutError(
                        "prompt_token_ids",
                        f"token {i} (id {int(tokens[i])}) lies in item {index}'s run but is "
                        f"not the {item.modality} placeholder id {wanted}",
                    )

    def to_proto(self) -> multimodal_pb2.MultimodalParams:
        """The `epd.v1.MultimodalParams` wire form (see `common.wire`)."""
        from common.wire.convert import params_to_proto

        return params_to_proto(self)

    @classmethod
    def from_proto(cls, msg: multimodal_pb2.MultimodalParams) -> MultimodalParams:
        """Validate and decode the wire form (see `common.wire`)."""
        from common.wire.convert import params_from_proto

        return params_from_proto(msg)


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
