"""A job's encoding pieces, and the layouts of the prefill steps that take them as they
arrive (`router.overlap`).

A piece is what one `Encode` call returns: a whole item, or, for an item with
`partition_keys` (a video keyed by its temporal patches, docs/block-hash.md), a span of its
consecutive partitions. `pieces_of` / `pieces_past` give one piece per partition (the skip
rule's unit); `batched` joins them into the spans the router encodes, small at both ends of
a video and up to `LARGEST` partitions in between: the first embeddings arrive early and
the last one leaves little for the job's own prefill, while the middle takes few `Encode`
calls and few prefill steps (each step costs an RPC, hashing, the digests of the cached
prefix, a partial block recomputed and a sampled token, on cores the encoder needs).
A prefill step covers the prompt's tokens `[0, n)`, `n` the first placeholder of the first
piece not yet encoded, so every item or partition before `n` has its embeddings.

Exactness (why a step's blocks are the whole prompt's): a step's full blocks must hash and
compute exactly as inside the whole prompt. Tokens are the prompt's own. An item wholly
before `n` is placed as it is. An item that `n` cuts is a partition-keyed one, and it is
placed as one item per piece (span of partitions) before `n`, and one per partition
without a piece (cached; `common.multimodal.partitions`: same block keys and positions as
inside the whole item). Later items and partitions lie past `n` and
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

LARGEST = 4  # partitions in the largest piece `batched` makes


@dataclass(frozen=True, slots=True)
class Piece:
    """One `Encode` call's worth of a job: a whole item, or one partition of it."""

    item: int  # index of the item in the prompt
    partition: int | None  # the (first) partition encoded, None: the whole item
    start: int  # prompt index of its first placeholder
    end: int  # one past its last placeholder
    width: int = 1  # partitions from `partition` on (1 for a whole item)

    @property
    def partitions(self) -> range:
        """The partitions it holds (empty for a whole item)."""
        if self.partition is None:
            return range(0)
        return range(self.partition, self.partition + self.width)


def piece_sizes(count: int, largest: int) -> list[int]:
    """Sizes (partitions) of the pieces `count` consecutive partitions are encoded as:
    doubling from 1 at the front and, mirrored, at the back, up to `largest` in the
    middle; they sum to `count`."""
    if largest < 1:
        raise ValueError(f"largest piece must be at least 1 partition, got {largest}")
    head: list[int] = []
    tail: list[int] = []
    size, left = 1, count
    while left > 0:
        for side in (head, tail):
            take = min(size, left)
            if take:
                side.append(take)
                left -= take
        size = min(2 * size, largest)
    return head + tail[::-1]


def batched(pieces: Sequence[Piece], largest: int = LARGEST) -> list[Piece]:
    """`pieces` (one per partition, prompt order, as `pieces_past` gives) with each item's
    consecutive partitions joined into spans sized by `piece_sizes`."""
    out: list[Piece] = []
    i = 0
    while i < len(pieces):
        j = i + 1
        if pieces[i].partition is not None:
            while j < len(pieces) and pieces[j].item == pieces[i].item:
                j += 1
        run = pieces[i:j]
        for size in piece_sizes(len(run), largest) if len(run) > 1 else [1]:
            first, last = run[0], run[size - 1]
            out.append(Piece(first.item, first.partition, first.start, last.end, size))
            run = run[size:]
        i = j
    return out


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
    arrived: Mapping[Piece, multimodal_pb2.ItemEmbedding],
    reused: int,
) -> multimodal_pb2.MultimodalParams:
    """The multimodal half of a prefill step over tokens `[0, n)`: every item before `n`
    (a cut partition-keyed item as one item per arrived piece and one per partition
    without one, see the module docstring), carrying the embeddings of the `arrived`
    pieces whose placeholders reach past `reused`, the tokens the worker is expected to
    reuse. An item before `n` without a piece needs none (it is cached)."""
    by_key = {(p.item, p.partition): p for p in arrived}
    items: list[MultimodalItemMetadata] = []
    embeddings: list[multimodal_pb2.ItemEmbedding | None] = []
    for i, item in enumerate(params.items):
        if item.position >= n:
            break
        if splits_by_partition(item):
            j = 0
            while j < len(item.runs):
                piece = by_key.get((i, j))
                stop = j + (piece.width if piece is not None else 1)
                start, length = item.runs[stop - 1]
                if start + length > n:
                    break
                items.append(partitions_item(item, j, stop))
                embeddings.append(None if piece is None else arrived[piece])
                j = stop
        elif item.end <= n:
            items.append(item)
            piece = by_key.get((i, None))
            embeddings.append(None if piece is None else arrived[piece])
    msg = MultimodalParams.from_items(items).to_proto()
    for index, (item, emb) in enumerate(zip(items, embeddings, strict=True)):
        if emb is not None and item.end > reused:
            out = msg.embeddings.add(item_index=index, rows=emb.rows)
            out.deepstack.extend(emb.deepstack)
    return msg
