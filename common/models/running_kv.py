"""Contiguous K/V of the running decode batch, so a decode step gathers no blocks.

The paged cache (`common.kv.cache.PagedKvCache`) stays the source of truth: transfers,
digests and prefix reuse read its blocks. `RunningKv` keeps a second copy of each running
sequence's K/V in one buffer

    [rows, num_layers, 2, num_kv_heads, capacity, head_dim]

whose row `r` holds one sequence's positions `0 .. length - 1`, laid out as attention reads
them (`[KV, T, D]` per layer), so decode attention reads `buffer[:B, layer, 0, :, :T]` as a
view. A sequence's row is filled once, by one gather of its blocks, when it first decodes;
afterwards `TextModel.decode` writes each new token's K/V to the paged cache and to the row
alike, so a step copies only the new tokens, not context x batch.

Validity: a row is reused only for the same sequence object, the same block ids and a length
equal to the sequence's computed tokens; anything else (a sequence that left and came back,
blocks replaced, a failed step) reloads the row from the paged cache. Rows of sequences that
are not in a step are dropped at that step, so a row never outlives its sequence's blocks by
more than one step and is never read after they are freed. Rows stay packed at `0 .. B - 1`:
dropping one moves the last row into its place (one sequence's copy, on leave only).

Memory: the batch's sequences x the longest length (rounded up to a power of two), in
addition to the paged cache, at most `BUDGET_OF_POOL` times the pool's token slots: a step
whose rows would pass that gathers blocks instead (`fits`; one long sequence among short
ones reserved its length for every row: 32 rows of 8192 slots beside a pool of 19,200). The
buffer grows by doubling and shrinks once four times larger than the batch needs.
Not thread-safe; owned by one `LmRunner` (its callers serialize every call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kv.cache import PagedKvCache
from common.models.sequence import LmSequence

_MIN_CAPACITY = 256  # token slots per row at first; doubled as sequences grow
BUDGET_OF_POOL = 2  # the rows' token slots at most, in the paged pool's (see the docstring)


@dataclass(eq=False, slots=True)
class _Row:
    seq: LmSequence  # whose K/V the row holds
    blocks: tuple[int, ...]  # the sequence's block ids when the row was filled
    length: int  # positions held (0 .. length - 1)


class RunningKv:
    """Contiguous per-sequence K/V rows of the decode batch (see the module docstring)."""

    def __init__(self, paged: PagedKvCache) -> None:
        self.paged = paged  # the source the rows are filled from
        spec = paged.spec
        self._shape = (spec.num_layers, 2, spec.num_kv_heads)
        self.buffer = torch.empty(
            (0, *self._shape, 0, spec.head_dim), dtype=spec.dtype, device=paged.device
        )
        self._rows: list[_Row] = []  # row i's sequence, rows packed at 0 .. len - 1
        self.loads = 0  # rows filled from the paged cache (a count for tests and benchmarks)
        self.budget = BUDGET_OF_POOL * spec.num_blocks * spec.block_size  # token slots

    def fits(self, seqs: list[LmSequence]) -> bool:
        """Whether rows for `seqs` (at least one) stay within `budget`."""
        rows, capacity = self._size(len(seqs), max(s.num_computed + 1 for s in seqs))
        return rows * capacity <= self.budget

    def arrange(self, seqs: list[LmSequence]) -> list[LmSequence]:
        """Make rows `0 .. len(seqs) - 1` hold exactly `seqs`' K/V (their `num_computed`
        positions) and return `seqs` in row order; rows of other sequences are dropped."""
        wanted = set(seqs)
        kept = [row for row in self._rows if row.seq in wanted and self._valid(row)]
        keep = {id(row) for row in kept}
        for r in range(len(self._rows) - 1, -1, -1):  # drop from the end: moves stay valid
            if id(self._rows[r]) not in keep:
                self._drop(r)
        held = {row.seq for row in self._rows}
        new = [s for s in seqs if s not in held]
        self._reserve(len(seqs), max(s.num_computed + 1 for s in seqs) if seqs else 0)
        for seq in new:
            self._load(seq)
        return [row.seq for row in self._rows]

    def view(self) -> torch.Tensor:
        """`[B, layers, 2, KV, capacity, D]`: the rows, in `arrange`'s order (a view)."""
        return self.buffer[: len(self._rows)]

    def advanced(self) -> None:
        """Each row gained its sequence's newest token (after a successful decode step)."""
        for row in self._rows:
            row.length += 1

    def clear(self) -> None:
        """Forget every row and free the buffer (after a failed step, or when idle)."""
        self._rows = []
        self.buffer = self.buffer.new_empty((0, *self.buffer.shape[1:4], 0, self.buffer.shape[5]))

    # ---------------------------------------------------------------------------- rows

    def _valid(self, row: _Row) -> bool:
        seq = row.seq
        return row.length == seq.num_computed and tuple(seq.blocks[: len(row.blocks)]) == (
            row.blocks
        )

    def _drop(self, r: int) -> None:
        last = len(self._rows) - 1
        if r != last:
            moved = self._rows[last]
            self.buffer[r, :, :, :, : moved.length].copy_(
                self.buffer[last, :, :, :, : moved.length]
            )
            self._rows[r] = moved
        self._rows.pop()

    def _size(self, rows: int, tokens: int) -> tuple[int, int]:
        """The buffer's (rows, capacity) for `rows` sequences of up to `tokens` positions:
        each doubled as needed, cut down once four times what is needed."""
        have_rows, capacity = self.buffer.shape[0], self.buffer.shape[4]
        need = _MIN_CAPACITY
        while need < tokens:
            need *= 2
        if capacity < need or capacity >= 4 * need:
            capacity = need
        if have_rows < rows:  # doubled, but not past the budget for a batch that fits it
            have_rows = max(rows, min(2 * have_rows, self.budget // capacity))
        elif have_rows >= 4 * max(rows, 2):
            have_rows = rows
        return have_rows, capacity

    def _reserve(self, rows: int, tokens: int) -> None:
        new_rows, new_capacity = self._size(rows, tokens)
        if (new_rows, new_capacity) == (self.buffer.shape[0], self.buffer.shape[4]):
            return
        buffer = self.buffer.new_zeros((new_rows, *self._shape, new_capacity, self.buffer.shape[5]))
        for r, row in enumerate(self._rows):
            buffer[r, :, :, :, : row.length].copy_(self.buffer[r, :, :, :, : row.length])
        self.buffer = buffer

    def _load(self, seq: LmSequence) -> None:
        """Append a row filled with `seq`'s positions `0 .. num_computed - 1` (one gather)."""
        length = seq.num_computed
        size = self.paged.spec.block_size
        used = seq.blocks[: (length + size - 1) // size]
        r = len(self._rows)
        if length:
            index = torch.tensor(used, dtype=torch.long, device=self.buffer.device)
            blocks = self.paged.buffer.index_select(0, index)  # [n, L, 2, S, KV, D]
            rows = blocks.permute(1, 2, 4, 0, 3, 5).flatten(3, 4)  # [L, 2, KV, n * S, D]
            self.buffer[r, :, :, :, :length].copy_(rows[:, :, :, :length])
        self._rows.append(_Row(seq, tuple(used), length))
        self.loads += 1


def new_token_slots(rows: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per layer, where a decode step's new K/V go in `rows [B, layers, 2, KV, capacity, D]`
    seen as `[-1, D]`: for sequence `b` at position `last[b]`, its K heads then its V heads
    (`[B * 2 * KV]` each, in `torch.stack((k, v), dim=1)` order)."""
    batch, layers, pair, heads, capacity, _ = rows.shape
    layer_stride = pair * heads * capacity
    device = rows.device
    head_base = torch.arange(pair * heads, device=device).view(1, -1) * capacity
    seq_base = torch.arange(batch, device=device) * layers * layer_stride + last
    per_layer = torch.arange(layers, device=device).view(-1, 1) * layer_stride
    return ((seq_base.view(-1, 1) + head_base).view(1, -1) + per_layer).unbind(0)
