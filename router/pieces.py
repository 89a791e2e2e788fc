"""A job's encoding pieces, and the layouts of the prefill steps that take them as they
arrive (`router.overlap`).

A piece is what one `Encode` call returns: a whole item, or, for an item with
`partition_keys` (a video keyed by its temporal patches, docs/block-hash.md), one partition.
A prefill step covers the prompt's tokens `[0, n)`, `n` the first placeholder of the first
piece not yet encoded, so every item or partition before `n` has its embeddings.

Exactness (why a step's blocks are the whole prompt's): a step's full blocks must hash and
compute exactly as inside the whole prompt. Tokens are the prompt's own. An item wholly
before `n` is placed as it is. An item that `n` cuts is a partition-keyed one, and it is
placed as one item per partition before `n` (`common.multimodal.partitions`: same block
keys and positions as inside the whole item). Later items and partitions lie past `n` and
touch no block before it. The worker's own hashing still decides reuse; the tests compare
hashes and positions with the whole prompt's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.multimodal.params import MultimodalItemMetadata, MultimodalParams
from common.multimodal.partitions import partitions_item, splits_by_partition
from epd.v1 import multimodal_pb2
from router.routing import PrefillRoute


@dataclass(frozen=True, slots=True)
class Piece:
    """One `Encode` call's worth of a job: a whole item, or one partition of it."""

    item: int  # index of the item in the prompt
    partition: int | None  # the partition encoded, None: the whole item
    start: int  # prompt index of its first placeholder
    end: int  # one past its last placeholder


def pieces_of(items: Sequence[MultimodalItemMetadata], to_encode: Sequence[int]) -> list[Piece]:
    """The pieces of the items at indexes `to_encode`, in prompt order."""
    out: list[Piece] = []
    for i in sorted(to_encode):
        item = items[i]
        if splits_by_partition(item):
            out.extend(Piece(i, j, s, s + n) for j, (s, n) in enumerate(item.runs))
        else:
            out.append(Piece(i, None, item.position, item.end))
    return out


def cached_tokens(route: PrefillRoute) -> int:
    """Prompt tokens inside the route's prefill worker's known cached prefix."""
    worker = route.worker
    if worker is None or worker.layout is None:
        return 0
    return route.cached_blocks * worker.layout.block_size


def pieces_past(
    items: Sequence[MultimodalItemMetadata], to_encode: Sequence[int], covered: int
) -> list[Piece]:
    """The partition skip rule: of the pieces of the items at `to_encode`, those a prefill
    worker whose cached prefix is the prompt's first `covered` tokens needs embeddings for,
    in prompt order: each with a placeholder at or past `covered` (the worker computes the
    tokens from there on; a partition whose run ends inside the prefix is cached KV)."""
    return [p for p in pieces_of(items, to_encode) if p.end > covered]


def partitions_past(
    items: Sequence[MultimodalItemMetadata], to_encode: Sequence[int], covered: int
) -> dict[int, int]:
    """For each item at `to_encode` whose needed pieces (`pieces_past`) leave out its
    leading partitions: the first partition needed (the item's embedding holds those from
    it on). Items needed whole are not listed."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    for piece in pieces_past(items, to_encode, covered):
        if piece.item not in seen:
            seen.add(piece.item)
            if piece.partition:
                out[piece.item] = piece.partition
    return out


def step_layout(
    params: MultimodalParams,
    n: int,
    pieces: Mapping[tuple[int, int | None], multimodal_pb2.ItemEmbedding],
    reused: int,
) -> multimodal_pb2.MultimodalParams:
    """The multimodal half of a prefill step over tokens `[0, n)`: every item before `n`
    (a cut partition-keyed item as one item per partition, see the module docstring),
    carrying the embeddings in `pieces` (by `(item, partition)`; partition None: the whole
    item) of those whose placeholders reach past `reused`, the tokens the worker is
    expected to reuse. An item before `n` without a piece needs none (it is cached)."""
    items: list[MultimodalItemMetadata] = []
    keys: list[tuple[int, int | None]] = []
    for i, item in enumerate(params.items):
        if item.position >= n:
            break
        if splits_by_partition(item):
            for j, (start, length) in enumerate(item.runs):
                if start + length > n:
                    break
                items.append(partitions_item(item, j, j + 1))
                keys.append((i, j))
        elif item.end <= n:
            items.append(item)
            keys.append((i, None))
    msg = MultimodalParams.from_items(items).to_proto()
    for index, (item, key) in enumerate(zip(items, keys, strict=True)):
        emb = pieces.get(key)
        if emb is not None and item.end > reused:
            out = msg.embeddings.add(item_index=index, rows=emb.rows)
            out.deepstack.extend(emb.deepstack)
    return msg
