"""How several prompts are prefilled together: pieces, and forwards under a token budget.

Each request's tokens `[start, total)` are cut into pieces of at most `chunk_size` tokens,
aligned from `start` exactly as when the request is prefilled alone; pieces are then packed,
in request order, into forwards of at most `token_budget` tokens. A piece is never split to
fill a forward, so a request computes the same pieces (and the same K/V) whether it is
prefilled alone or with others; a piece longer than the budget gets a forward of its own.
A later piece of a request may share a forward with an earlier one: the forward writes every
piece's K/V of a layer before any piece attends, so the later piece reads them from the cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from common.multimodal.params import ItemEmbedding, MultimodalItemMetadata


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """One sequence's prompt to compute from `start` on (tokens before it are cached)."""

    block_table: torch.Tensor  # int64 [blocks]: the sequence's block ids
    token_ids: torch.Tensor  # int64 [N]: the whole prompt
    positions: torch.Tensor  # int64 [3, N]: the prompt's mRoPE positions
    start: int = 0  # first token to compute
    items: Sequence[MultimodalItemMetadata] = ()  # the prompt's multimodal items
    embeddings: Mapping[int, ItemEmbedding] = field(default_factory=dict)  # by item index
    all_logits: bool = False  # logits of every computed token, not only the last

    def __post_init__(self) -> None:
        total = int(self.token_ids.shape[0])
        if not 0 <= self.start < total:
            raise ValueError(f"start {self.start} outside a prompt of {total} tokens")


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens `[lo, hi)` of request `request` (an index into the planned requests)."""

    request: int
    lo: int
    hi: int


def plan_forwards(
    spans: Sequence[tuple[int, int]], chunk_size: int | None, token_budget: int | None
) -> list[list[Piece]]:
    """Pieces of each `(start, total)` span, grouped into forwards (see the module docstring).

    `chunk_size` None: one piece per span. `token_budget` None: `chunk_size` when set, else
    unbounded (everything in one forward).
    """
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    budget = token_budget if token_budget is not None else chunk_size
    if budget is not None and budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    forwards: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for request, (start, total) in enumerate(spans):
        step = chunk_size or total - start
        for lo in range(start, total, step):
            hi = min(total, lo + step)
            if current and budget is not None and used + hi - lo > budget:
                forwards.append(current)
                current, used = [], 0
            current.append(Piece(request, lo, hi))
            used += hi - lo
    if current:
        forwards.append(current)
    return forwards
