"""Byte ranges for NIXL transfers: validation and merging of adjacent ranges.

A transfer is a list of (remote range, local range) pairs of equal length. NIXL's speed
depends on descriptor size (DESIGN §4: 64 KiB descriptors reach 0.43x of one large one), so
runs of pairs that are contiguous on BOTH sides are merged into one descriptor before posting.

Everything here is pure (numpy over int64, no NIXL), vectorized because a KV pull can carry
thousands of blocks and per-range Python loops would cost milliseconds, as much as the copy.
Ranges come as a sequence of (address, nbytes) tuples or an Nx2 integer array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# (start address, length in bytes) in some process's address space.
ByteRange = tuple[int, int]
# Nx2 int64 array of (address, nbytes) rows.
RangeArray = npt.NDArray[np.int64]
Ranges = Sequence[ByteRange] | RangeArray


def as_range_array(ranges: Ranges, what: str = "ranges") -> RangeArray:
    """Ranges as an Nx2 int64 array (a copy only when the input is not one already)."""
    arr = np.asarray(ranges, dtype=np.int64)
    if arr.size == 0:
        return arr.reshape(0, 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what} must be (address, nbytes) pairs, got shape {arr.shape}")
    return arr


def check_pairs(remote: Ranges, local: Ranges) -> tuple[RangeArray, RangeArray]:
    """Validate a one-to-one copy and return both sides as Nx2 arrays.

    Rules: same number of ranges; at least one; every length positive and equal pairwise;
    addresses non-negative; local ranges pairwise disjoint (two remote ranges may overlap,
    reading the same bytes twice is harmless, but two writes to one local byte are a bug).
    Raises ValueError naming the first offending range.
    """
    r = as_range_array(remote, "remote")
    loc = as_range_array(local, "local")
    if len(r) != len(loc):
        raise ValueError(
            f"remote and local must have the same number of ranges, got {len(r)} "
            f"remote and {len(loc)} local"
        )
    if len(r) == 0:
        raise ValueError("nothing to transfer: no ranges given")
    bad = np.flatnonzero((r[:, 1] <= 0) | (loc[:, 1] <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"range {i}: lengths must be positive, got {r[i, 1]} and {loc[i, 1]}")
    bad = np.flatnonzero(r[:, 1] != loc[:, 1])
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"range {i}: remote length {r[i, 1]} differs from local length "
                         f"{loc[i, 1]}")
    bad = np.flatnonzero((r[:, 0] < 0) | (loc[:, 0] < 0))
    if bad.size:
        raise ValueError(f"range {int(bad[0])}: negative address")
    ordered = loc[np.argsort(loc[:, 0], kind="stable")]
    bad = np.flatnonzero(ordered[:-1, 0] + ordered[:-1, 1] > ordered[1:, 0])
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"local ranges overlap: [{ordered[i, 0]:#x}, +{ordered[i, 1]}) and a range at "
            f"{ordered[i + 1, 0]:#x}"
        )
    return r, loc


def merge_range_arrays(
    remote: RangeArray,
    local: RangeArray,
    local_region: npt.NDArray[np.int64] | None = None,
) -> tuple[RangeArray, RangeArray]:
    """`merge_ranges` on validated Nx2 arrays; returns Nx2 arrays.

    `local_region`, if given, labels each pair with the registered region of its local range;
    pairs in different regions are never merged (NIXL needs each descriptor inside one
    registration, and two registrations can happen to be adjacent in memory).
    """
    order = np.lexsort((local[:, 0], remote[:, 0]))
    r = remote[order]
    loc = local[order]
    joins = (r[1:, 0] == r[:-1, 0] + r[:-1, 1]) & (loc[1:, 0] == loc[:-1, 0] + loc[:-1, 1])
    if local_region is not None:
        reg = local_region[order]
        joins &= reg[1:] == reg[:-1]
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    lengths = np.add.reduceat(r[:, 1], starts)
    out_r = np.stack((r[starts, 0], lengths), axis=1)
    out_l = np.stack((loc[starts, 0], lengths), axis=1)
    return out_r, out_l


def merge_ranges(remote: Ranges, local: Ranges) -> tuple[list[ByteRange], list[ByteRange]]:
    """Merge pairs that are contiguous on both sides into single descriptors.

    Pairs are first ordered by remote address (the copy is a set of pairs, so order does not
    matter), then each pair is folded into the current run when it starts exactly where the
    run ends on the remote side AND on the local side. The result moves exactly the same
    bytes to the same places, with never more descriptors than the input, and no two
    neighbouring output pairs could be merged further. Raises ValueError for inputs that
    `check_pairs` rejects.
    """
    r, loc = check_pairs(remote, local)
    out_r, out_l = merge_range_arrays(r, loc)
    return (
        [(int(a), int(n)) for a, n in out_r.tolist()],
        [(int(a), int(n)) for a, n in out_l.tolist()],
    )
