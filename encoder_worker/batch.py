"""One encoder batch's tensors: the tower's input per encoding mode, and its output split
back into per-unit cache entries.

The number of tensor operations per batch does not grow with its units: per encoding mode
one `cat` of the units' patch rows, one mapping of the codes to the tower's values
(`values`: `common.processing.image.as_patch_values`) and one grid tensor (built through
numpy, not from a Python list of tuples); per output segment one copy (main and deepstack
rows stacked) and one `split` into the units' views. Units whose rows lie side by side in
one segment (the partitions of one video) are joined by one view, not a copy (`join`).

Segments: the tower's output of a mode is copied in pieces of at most `SEGMENT_BYTES`
(cut at unit boundaries; a larger unit is a segment of its own), so a unit kept in the cache
keeps at most that much of other units' rows alive, never the whole batch output, while
the copies per batch stay a handful rather than one per request or unit.

Pure functions of their arguments; they run on the engine's forward thread.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from encoder_worker.cache import EncodedRows
from encoder_worker.requests import Unit

SEGMENT_BYTES: Final = 1 << 20  # output bytes (all layers) one copied segment holds at most

_grid = operator.attrgetter("grid")
_output_rows = operator.attrgetter("output_rows")
_key = operator.attrgetter("key")
_pixels = operator.attrgetter("pixels")


@dataclass(slots=True, eq=False)
class ModeInput:
    """The tower's input for the units of one encoding mode, in batch order."""

    per_frame: bool  # the mode: frame by frame (exact partitions) or whole items
    units: list[Unit]  # in batch order
    pixels: torch.Tensor  # (sum of input_rows, patch_dim): the units' patch rows, values
    grids: torch.Tensor  # (len(units), 3) int64 patch grid per unit


@dataclass(slots=True, eq=False)
class Segment:
    """Cache entries of consecutive units that share one copied piece of tower output."""

    owner: EncodedRows  # the copy; each entry is a view of it (or it, for a lone unit)
    keys: list[bytes]  # the units' keys, in order
    entries: list[EncodedRows]  # one per key


Values = Callable[[torch.Tensor], torch.Tensor]  # patch rows (codes or values) -> values


def mode_inputs(units: Sequence[Unit], values: Values) -> list[ModeInput]:
    """The tower inputs of `units`: whole-item units first, then frame-by-frame ones, each
    mode in the given order; modes without units are left out. `values` maps patch rows to
    the tower's float values (codes mapped, values kept)."""
    if not units:
        return []
    whole = [u for u in units if not u.per_frame]
    if len(whole) == len(units):
        return [_mode_input(False, whole, values)]
    framed = [u for u in units if u.per_frame]
    modes = [_mode_input(True, framed, values)]
    if whole:
        modes.insert(0, _mode_input(False, whole, values))
    return modes


def _mode_input(per_frame: bool, units: list[Unit], values: Values) -> ModeInput:
    flat = np.fromiter(
        itertools.chain.from_iterable(map(_grid, units)), dtype=np.int64, count=3 * len(units)
    )
    rows = list(map(_pixels, units))
    pixels = rows[0] if len(rows) == 1 else torch.cat(rows)
    if pixels.dtype != torch.uint8 and any(r.dtype == torch.uint8 for r in rows):
        # Codes and values (a rolling upgrade's mix): `cat` promoted the codes; map each.
        pixels = torch.cat([values(r) for r in rows])
    return ModeInput(per_frame, units, values(pixels), torch.from_numpy(flat).view(-1, 3))


def split_output(
    units: list[Unit], rows: torch.Tensor, deepstack: Sequence[torch.Tensor]
) -> list[Segment]:
    """The tower's output for `units` (`rows` and each deepstack layer, units' rows in
    order) as cache entries: copied segments of at most `SEGMENT_BYTES`, a view per unit."""
    tensors = (rows, *deepstack)
    sizes = list(map(_output_rows, units))
    keys = list(map(_key, units))
    bounds = list(itertools.accumulate(sizes, initial=0))  # first row of each unit
    row_bytes = rows.shape[1] * rows.element_size() * len(tensors)
    limit = max(1, SEGMENT_BYTES // row_bytes)  # rows per segment
    segments = []
    first = 0
    while first < len(units):
        # The most units from `first` whose rows fit the limit (at least one).
        last = max(first + 1, bisect.bisect_right(bounds, bounds[first] + limit, first) - 1)
        start, count = bounds[first], bounds[last] - bounds[first]
        if first == 0 and last == len(units):
            stacked = torch.stack(tensors)
        else:
            stacked = torch.stack([t.narrow(0, start, count) for t in tensors])
        owner = EncodedRows(stacked)
        if last - first == 1:
            entries = [owner]
        else:
            views = stacked.split(sizes[first:last], dim=1)
            ends = list(itertools.accumulate(sizes[first:last]))
            starts = itertools.chain((0,), ends)
            entries = list(map(EncodedRows, views, itertools.repeat(owner), starts, ends))
        segments.append(Segment(owner, keys[first:last], entries))
        first = last
    return segments


def join(parts: Sequence[EncodedRows]) -> EncodedRows:
    """The rows of `parts` concatenated in order: one view when they lie side by side in one
    segment (bit-identical to a copy), else one `cat`."""
    if len(parts) == 1:
        return parts[0]
    owner = parts[0].owner
    if owner is not None:
        end = parts[0].start
        for part in parts:
            if part.owner is not owner or part.start != end or part.stop <= end:
                break
            end = part.stop
        else:
            first = parts[0].start
            return EncodedRows(owner.stacked.narrow(1, first, end - first), owner, first, end)
    return EncodedRows(torch.cat([p.stacked for p in parts], dim=1))
