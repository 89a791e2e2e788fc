"""Byte ranges for NIXL transfers: validation and merging of adjacent ranges.

A transfer is a list of (remote range, local range) pairs of equal length. NIXL's speed
depends on descriptor size (DESIGN §4: 64 KiB descriptors reach 0.43x of one large one), so
runs of pairs that are contiguous on BOTH sides are merged into one descriptor before posting.

Everything here is pure (no NIXL). Two implementations with one contract: plain Python for a
few dozen ranges (numpy's per-call overhead would dominate), numpy for thousands of blocks
(Python loops would cost milliseconds, as much as the copy itself).
Ranges come as a sequence of (address, nbytes) tuples or an Nx2 integer array.
"""

from __future__ import annotations

import itertools
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
    if not isinstance(ranges, np.ndarray):
        # fromiter over the flattened pairs is several times faster than asarray on tuples.
        try:
            flat = np.fromiter(
                itertools.chain.from_iterable(ranges), dtype=np.int64, count=2 * len(ranges)
            )
            return flat.reshape(-1, 2)
        except (TypeError, ValueError):
            pass  # ragged or malformed: let asarray produce the shape error below
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
        raise ValueError(
            f"range {i}: remote length {r[i, 1]} differs from local length {loc[i, 1]}"
        )
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


def check_pair_lists(
    remote: Sequence[ByteRange], local: Sequence[ByteRange]
) -> tuple[list[ByteRange], list[ByteRange]]:
    """`check_pairs` in plain Python, faster than numpy for a few dozen ranges."""
    if len(remote) != len(local):
        raise ValueError(
            f"remote and local must have the same number of ranges, got {len(remote)} "
            f"remote and {len(local)} local"
        )
    if not remote:
        raise ValueError("nothing to transfer: no ranges given")
    r = [(int(a), int(n)) for a, n in remote]
    loc = [(int(a), int(n)) for a, n in local]
    for i, ((r_addr, r_len), (l_addr, l_len)) in enumerate(zip(r, loc, strict=True)):
        if r_len <= 0 or l_len <= 0:
            raise ValueError(f"range {i}: lengths must be positive, got {r_len} and {l_len}")
        if r_len != l_len:
            raise ValueError(f"range {i}: remote length {r_len} differs from local length {l_len}")
        if r_addr < 0 or l_addr < 0:
            raise ValueError(f"range {i}: negative address")
    ordered = sorted(loc)
    for (a_addr, a_len), (b_addr, _) in itertools.pairwise(ordered):
        if a_addr + a_len > b_addr:
            raise ValueError(
                f"local ranges overlap: [{a_addr:#x}, +{a_len}) and a range at {b_addr:#x}"
            )
    return r, loc


def merge_range_lists(
    remote: Sequence[ByteRange],
    local: Sequence[ByteRange],
    local_region: Sequence[int] | None = None,
) -> tuple[list[ByteRange], list[ByteRange]]:
    """`merge_range_arrays` in plain Python on validated lists; returns lists."""
    regions = local_region if local_region is not None else [0] * len(remote)
    triples = sorted(zip(remote, local, regions, strict=True), key=lambda p: (p[0][0], p[1][0]))
    out_r: list[ByteRange] = []
    out_l: list[ByteRange] = []
    run_r = run_l = run_len = run_reg = 0
    for (r_addr, length), (l_addr, _), reg in triples:
        if run_len and r_addr == run_r + run_len and l_addr == run_l + run_len and reg == run_reg:
            run_len += length
            continue
        if run_len:
            out_r.append((run_r, run_len))
            out_l.append((run_l, run_len))
        run_r, run_l, run_len, run_reg = r_addr, l_addr, length, reg
    out_r.append((run_r, run_len))
    out_l.append((run_l, run_len))
    return out_r, out_l


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
    if isinstance(remote, np.ndarray) or isinstance(local, np.ndarray):
        r, loc = check_pairs(remote, local)
        out_r, out_l = merge_range_arrays(r, loc)
        return (
            [(int(a), int(n)) for a, n in out_r.tolist()],
            [(int(a), int(n)) for a, n in out_l.tolist()],
        )
    return merge_range_lists(*check_pair_lists(remote, local))


def merge_for_read(
    remote: Ranges, local: Ranges, local_region: Sequence[int] | npt.NDArray[np.int64] | None
) -> tuple[RangeArray, RangeArray]:
    """Both sides of a checked copy as Nx2 arrays, merged within `local_region` ids (None:
    not merged). Lists take the plain-Python merge, arrays the numpy one."""
    if isinstance(remote, np.ndarray) and isinstance(local, np.ndarray):
        if local_region is None:
            return remote, local
        return merge_range_arrays(remote, local, np.asarray(local_region, dtype=np.int64))
    r_list, l_list = list(remote), list(local)
    if local_region is not None:
        r_list, l_list = merge_range_lists(r_list, l_list, list(local_region))
    return np.array(r_list, dtype=np.int64), np.array(l_list, dtype=np.int64)
