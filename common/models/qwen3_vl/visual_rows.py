"""Multimodal rows of a prefill: which embedding rows land on which tokens of a forward.

`visual_inputs` gathers, for prompt tokens `[start, end)` of one sequence, the rows of every
item run overlapping them (and their deepstack features); `packed_visual` shifts several
segments' rows to their place in a packed forward. The text model scatters them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from common.models.qwen3_vl.attention import SegmentSpan
from common.multimodal.params import ItemEmbedding, MultimodalItemMetadata


@dataclass(frozen=True, slots=True)
class VisualInputs:
    """Multimodal rows to place inside one prefill chunk."""

    # int64 [R]: chunk-local token indices that receive a row.
    index: torch.Tensor
    # [R, hidden]: replaces the token embedding at `index`.
    rows: torch.Tensor
    # One [R, hidden] per early layer: added to that layer's output at `index`.
    deepstack: tuple[torch.Tensor, ...]


def visual_inputs(
    items: Sequence[MultimodalItemMetadata],
    embeddings: Mapping[int, ItemEmbedding],
    start: int,
    end: int,
) -> VisualInputs | None:
    """Gather the rows of every run overlapping prompt tokens `[start, end)`.

    `embeddings` is keyed by item index; an item whose runs miss the range needs none (it may
    lie wholly in a reused prefix). Raises KeyError when a needed embedding is missing.
    """
    index: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    deep: list[list[torch.Tensor]] = []
    for i, item in enumerate(items):
        placed = 0  # item rows placed by earlier runs
        for run_start, length in item.runs:
            lo, hi = max(start, run_start), min(end, run_start + length)
            if lo < hi:
                if i not in embeddings:
                    raise KeyError(
                        f"item {i} overlaps tokens [{start}, {end}) but has no embedding"
                    )
                emb = embeddings[i]
                first = placed + lo - run_start
                index.append(torch.arange(lo - start, hi - start))
                rows.append(emb.rows[first : first + hi - lo])
                if not deep:
                    deep = [[] for _ in emb.deepstack]
                if len(emb.deepstack) != len(deep):
                    raise ValueError("items disagree on the number of deepstack layers")
                for layer, feat in enumerate(emb.deepstack):
                    deep[layer].append(feat[first : first + hi - lo])
            placed += length
    if not index:
        return None
    return VisualInputs(torch.cat(index), torch.cat(rows), tuple(torch.cat(d) for d in deep))


def packed_visual(
    visuals: Sequence[VisualInputs | None], spans: Sequence[SegmentSpan]
) -> VisualInputs | None:
    """The segments' multimodal rows with indices shifted to the packed forward."""
    present = [(v, s) for v, s in zip(visuals, spans, strict=True) if v is not None]
    if not present:
        return None
    if len(present) == 1 and present[0][1].offset == 0:
        return present[0][0]
    depth = {len(v.deepstack) for v, _ in present}
    if len(depth) != 1:
        raise ValueError("items disagree on the number of deepstack layers")
    return VisualInputs(
        torch.cat([v.index + s.offset for v, s in present]),
        torch.cat([v.rows for v, _ in present]),
        tuple(torch.cat(layer) for layer in zip(*(v.deepstack for v, _ in present), strict=True)),
    )
