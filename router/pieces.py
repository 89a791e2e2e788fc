"""A job's encoding pieces, and the layouts of the prefill steps that take them as they
arrive (`router.overlap`).

A piece is what one `Encode` call returns: a whole item, or, for an item with
`partition_keys` (a video keyed by its temporal patches, docs/block-hash.md), one partition.
A prefill step covers the prompt's tokens `[0, n)`, `n` the first placeholder of the first
piece not yet encoded, so every item or partition before `n` has its embeddings.

Exactness (why a step's blocks are the whole prompt's): a step's full blocks must hash and
compute exactly as inside the whole prompt. Tokens are the prompt's own. An item wholly
before `n` is placed as it is. An item that `n` cuts is a partition-keyed one, and it is
placed as one item per partition before `n`: partition `j` as an item whose one partition is
`j` (same hash, rows, uuid, `partition_keys`), whose one run is the item's run `j` (the rule
pairs partitions and runs one to one) and whose grid is the partition's `(t_j, h, w)`. Its
block keys are `(partition hash, partition-local row, uuid)`, the whole item's keys for
those rows byte for byte, and mRoPE positions each frame from the text position where its
run starts and `(h, w)` alone (`common.models.qwen3_vl.rope`), so positions are those of the
whole prompt too. Later items and partitions lie past `n` and touch no block before it. The
worker's own hashing still decides reuse; the tests compare hashes and positions with the
whole prompt's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.multimodal.params import ItemPartition, MultimodalItemMetadata, MultimodalParams
from epd.v1 import multimodal_pb2, tensor_pb2


@dataclass(frozen=True, slots=True)
class Piece:
    """One `Encode` call's worth of a job: a whole item, or one partition of it."""

    item: int  # index of the item in the prompt
    partition: int | None  # the partition encoded, None: the whole item
    start: int  # prompt index of its first placeholder
    end: int  # one past its last placeholder


def splits_by_partition(item: MultimodalItemMetadata) -> bool:
    """Whether the item is encoded and placed partition by partition: it keys its blocks by
    partition, and its partitions pair one to one with its runs."""
    return item.partition_keys and len(item.partitions) == len(item.runs) > 1


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


def partition_item(item: MultimodalItemMetadata, j: int) -> MultimodalItemMetadata:
    """Partition `j` of a `splits_by_partition` item as an item of its own (see the module
    docstring: same block keys and positions as inside the whole item)."""
    part = item.partitions[j]
    inputs = part.input_end - part.input_start
    grid = item.grid_thw
    times: tuple[float, ...] = ()
    if grid is not None:
        per_t = grid[1] * grid[2]
        t_j, first = inputs // per_t, part.input_start // per_t
        grid = (t_j, grid[1], grid[2])
        if len(item.frame_timestamps) >= first + t_j:
            times = item.frame_timestamps[first : first + t_j]
    return MultimodalItemMetadata(
        content_hash=part.content_hash,
        runs=(item.runs[j],),
        modality=item.modality,
        payload_index=item.payload_index,
        uuid=item.uuid,
        partitions=(ItemPartition(0, inputs, part.output_rows, part.content_hash),),
        grid_thw=grid,
        frame_timestamps=times,
        partition_keys=True,
    )


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
                items.append(partition_item(item, j))
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


def joined(
    item: int, parts: Sequence[multimodal_pb2.ItemEmbedding]
) -> multimodal_pb2.ItemEmbedding | None:
    """The whole item's embedding from its partitions' (in order), when every one is
    inline (rows are row-major, so the item's bytes are theirs one after the other); None
    when one is held by a NIXL handle."""
    layers = [[p.rows, *p.deepstack] for p in parts]
    if any(ref.WhichOneof("data") != "inline_data" for refs in layers for ref in refs):
        return None
    out = multimodal_pb2.ItemEmbedding(item_index=item)
    tensors = [_concat([refs[k] for refs in layers]) for k in range(len(layers[0]))]
    out.rows.CopyFrom(tensors[0])
    out.deepstack.extend(tensors[1:])
    return out


def _concat(refs: Sequence[tensor_pb2.TensorRef]) -> tensor_pb2.TensorRef:
    first = refs[0]
    shape = [sum(int(r.shape[0]) for r in refs), *first.shape[1:]]
    return tensor_pb2.TensorRef(
        dtype=first.dtype, shape=shape, inline_data=b"".join(r.inline_data for r in refs)
    )
