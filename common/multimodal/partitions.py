"""A partition-keyed item cut into pieces that are items of their own, placed and keyed as
inside the whole item.

An item `splits_by_partition` when its blocks are keyed by partition (`partition_keys`,
docs/block-hash.md) and its partitions pair one to one with its runs (a video: one
temporal patch per run). Partitions `[start, stop)` of such an item, as an item of their
own (`partitions_item`), have the item's runs `start .. stop - 1`, those partitions (input
rows from 0), the item's uuid and `partition_keys`, and the grid `(t, h, w)` with `t` the
temporal patches they hold. Its block keys are `(partition hash, partition-local row,
uuid)`, the whole item's keys for those rows byte for byte; and mRoPE positions each frame
from the text position where its run starts and `(h, w)` alone
(`common.models.qwen3_vl.rope`), so a prompt whose item is replaced by its pieces in order
hashes, places and computes exactly as the whole prompt. The router uses it to prefill a
video's leading partitions before the rest is encoded (`router.pieces`), and a prefill
worker to take embeddings of only the partitions past its cached prefix
(`prefill_worker.partitions`). Nothing is cached under a piece's own content hash: it is
the partition's for a single one, else a digest of the partitions' hashes (`group_hash`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from common.multimodal.params import ItemPartition, MultimodalItemMetadata

_GROUP_TAG = b"epd.partition-group.v1"


def splits_by_partition(item: MultimodalItemMetadata) -> bool:
    """Whether the item can be placed partition by partition: it keys its blocks by
    partition, and its partitions pair one to one with its runs."""
    return item.partition_keys and len(item.partitions) == len(item.runs) > 1


def group_hash(parts: Sequence[ItemPartition]) -> bytes:
    """Content hash of a piece of partitions: the partition's own for one, else SHA-256
    over a tag and their hashes in order."""
    if len(parts) == 1:
        return parts[0].content_hash
    h = hashlib.sha256(_GROUP_TAG)
    for part in parts:
        h.update(part.content_hash)
    return h.digest()


def partitions_item(item: MultimodalItemMetadata, start: int, stop: int) -> MultimodalItemMetadata:
    """Partitions `[start, stop)` of a `splits_by_partition` item as an item of their own
    (see the module docstring). Raises ValueError for an empty or out-of-range span."""
    if not 0 <= start < stop <= len(item.partitions):
        raise ValueError(f"partitions [{start}, {stop}) of an item with {len(item.partitions)}")
    chosen = item.partitions[start:stop]
    base = chosen[0].input_start
    inputs = chosen[-1].input_end - base
    grid = item.grid_thw
    times: tuple[float, ...] = ()
    if grid is not None:
        per_t = grid[1] * grid[2]
        t, first = inputs // per_t, base // per_t
        grid = (t, grid[1], grid[2])
        if len(item.frame_timestamps) >= first + t:
            times = item.frame_timestamps[first : first + t]
    return MultimodalItemMetadata(
        content_hash=group_hash(chosen),
        runs=item.runs[start:stop],
        modality=item.modality,
        payload_index=item.payload_index,
        uuid=item.uuid,
        partitions=tuple(
            ItemPartition(p.input_start - base, p.input_end - base, p.output_rows, p.content_hash)
            for p in chosen
        ),
        grid_thw=grid,
        frame_timestamps=times,
        partition_keys=True,
    )
