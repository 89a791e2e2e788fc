"""Prefill of a video given only some partitions' embeddings (`ItemEmbedding.partition_start`).

The router sends the whole prompt's layout and, for a partition-keyed video whose leading
partitions lie inside this worker's cached prefix, embeddings of only the partitions past
it (one embedding per span of partitions). `split_for_prefill` places each such item as
its pieces (`common.multimodal.partitions.partitions_item`): one item per span given, and
one per span between them (no embeddings), in order. The pieces hash, place and compute
exactly as the whole item, so the worker computes from the split layout while the block
hashes and the prompt digest (what the decode worker checks, DESIGN §4) come from the whole
layout it was sent; the split is this worker's own, made from that layout, so the handle
it signs still names the prompt it computed. A piece it must compute that has no
embeddings (the cached prefix moved on) fails the prefill as a missing item does
(FAILED_PRECONDITION), and the router encodes again.

Errors name the field (INVALID_ARGUMENT): a span outside the item's partitions, spans that
overlap, spans for an item that cannot split, an item given both whole and partial rows, or
whole rows for no item or for an item twice (as `embeddings_from_proto` refuses them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from common.multimodal.params import MultimodalItemMetadata, MultimodalParams
from common.multimodal.partitions import partitions_item, splits_by_partition
from common.multimodal.validation import MultimodalLayoutError
from common.wire.convert import embeddings_by_item, params_from_proto
from epd.v1 import multimodal_pb2

FIELD = "embeddings.partition_start"


def split_for_prefill(
    msg: multimodal_pb2.MultimodalParams,
) -> tuple[MultimodalParams | None, multimodal_pb2.MultimodalParams, list[int] | None]:
    """`(whole layout, message to compute, origins)`: `(None, msg, None)` when no embedding
    names partitions; else the validated whole layout (no embeddings), `msg` with each item
    that has partition embeddings placed as its pieces, embeddings moved to them (see the
    module docstring), and each piece's item index in `msg` (`origins[piece]`: errors about
    a piece name the caller's item). Raises `MultimodalLayoutError` naming the field."""
    if not any(emb.HasField("partition_start") for emb in msg.embeddings):
        return None, msg, None
    whole = params_from_proto(msg, with_embeddings=False)
    spans = _spans(msg.embeddings, whole.items)
    items: list[MultimodalItemMetadata] = []
    origins: list[int] = []  # per piece, its item's index
    embeddings: list[tuple[int, multimodal_pb2.ItemEmbedding]] = []  # (new index, embedding)
    whole_rows = embeddings_by_item(
        (emb for emb in msg.embeddings if not emb.HasField("partition_start")), len(whole.items)
    )
    for i, item in enumerate(whole.items):
        given = spans.get(i)
        if given is None:
            if i in whole_rows:
                embeddings.append((len(items), whole_rows[i]))
            items.append(item)
            origins.append(i)
            continue
        for start, stop, emb in _pieces(given, len(item.partitions)):
            if emb is not None:
                embeddings.append((len(items), emb))
            items.append(partitions_item(item, start, stop))
            origins.append(i)
    out = MultimodalParams.from_items(
        items, mrope_position_delta=whole.mrope_position_delta
    ).to_proto()
    for index, emb in embeddings:
        moved = out.embeddings.add(item_index=index, rows=emb.rows)
        moved.deepstack.extend(emb.deepstack)
    return whole, out, origins


def _spans(
    embeddings: Sequence[multimodal_pb2.ItemEmbedding], items: Sequence[MultimodalItemMetadata]
) -> dict[int, list[tuple[int, int, multimodal_pb2.ItemEmbedding]]]:
    """Partition spans given per item, sorted and checked disjoint."""
    out: dict[int, list[tuple[int, int, multimodal_pb2.ItemEmbedding]]] = {}
    for emb in embeddings:
        if not emb.HasField("partition_start"):
            continue
        i = emb.item_index
        if i >= len(items):
            raise MultimodalLayoutError("embeddings.item_index", "no such item", i)
        if not splits_by_partition(items[i]):
            raise MultimodalLayoutError(
                FIELD, "the item has no partition keys with one partition per run", i
            )
        count = len(items[i].partitions)
        if not emb.partition_start < emb.partition_end <= count:
            raise MultimodalLayoutError(
                FIELD,
                f"partitions [{emb.partition_start}, {emb.partition_end}) of an item with {count}",
                i,
            )
        out.setdefault(i, []).append((emb.partition_start, emb.partition_end, emb))
    for i, given in out.items():
        given.sort(key=lambda span: span[0])
        if any(a[1] > b[0] for a, b in itertools.pairwise(given)):
            raise MultimodalLayoutError(FIELD, "partition spans overlap", i)
    whole = {e.item_index for e in embeddings if not e.HasField("partition_start")}
    for i in whole & out.keys():
        raise MultimodalLayoutError(FIELD, "the item carries whole and partition rows", i)
    return out


def _pieces(
    given: Sequence[tuple[int, int, multimodal_pb2.ItemEmbedding]], count: int
) -> list[tuple[int, int, multimodal_pb2.ItemEmbedding | None]]:
    """The item's pieces in order: each span given, and each gap between them (None)."""
    out: list[tuple[int, int, multimodal_pb2.ItemEmbedding | None]] = []
    at = 0
    for start, stop, emb in given:
        if start > at:
            out.append((at, start, None))
        out.append((start, stop, emb))
        at = stop
    if at < count:
        out.append((at, count, None))
    return out
