"""Byte ranges for NIXL transfers: validation and merging of adjacent ranges.

A transfer is a list of (remote range, local range) pairs of equal length. NIXL's speed
depends on descriptor size (DESIGN §4: 64 KiB descriptors reach 0.43x of one large one), so
runs of pairs that are contiguous on BOTH sides are merged into one descriptor before posting.
Everything here is pure Python over ints, with no NIXL dependency, so it is unit-testable
anywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

# (start address, length in bytes) in some process's address space.
ByteRange = tuple[int, int]


def check_pairs(remote: Sequence[ByteRange], local: Sequence[ByteRange]) -> None:
    """Raise ValueError unless `remote` and `local` describe a valid one-to-one copy.

    Rules: same number of ranges; at least one; every length positive and equal pairwise;
    addresses non-negative; local ranges pairwise disjoint (two remote ranges may overlap,
    reading the same bytes twice is harmless, but two writes to the same local byte are a bug).
    """
    if len(remote) != len(local):
        raise ValueError(
            f"remote and local must have the same number of ranges, got {len(remote)} "
            f"remote and {len(local)} local"
        )
    if not remote:
        raise ValueError("nothing to transfer: no ranges given")
    for i, ((r_addr, r_len), (l_addr, l_len)) in enumerate(zip(remote, local, strict=True)):
        if r_len <= 0 or l_len <= 0:
            raise ValueError(f"range {i}: lengths must be positive, got {r_len} and {l_len}")
        if r_len != l_len:
            raise ValueError(
                f"range {i}: remote length {r_len} differs from local length {l_len}"
            )
        if r_addr < 0 or l_addr < 0:
            raise ValueError(f"range {i}: negative address")
    ordered = sorted(local)
    for (a_addr, a_len), (b_addr, _) in itertools.pairwise(ordered):
        if a_addr + a_len > b_addr:
            raise ValueError(
                f"local ranges overlap: [{a_addr:#x}, +{a_len}) and a range at {b_addr:#x}"
            )


def merge_ranges(
    remote: Sequence[ByteRange], local: Sequence[ByteRange]
) -> tuple[list[ByteRange], list[ByteRange]]:
    """Merge pairs that are contiguous on both sides into single descriptors.

    Pairs are first ordered by remote address (the copy is a set of pairs, so order does not
    matter), then pair i+1 is folded into the current run when it starts exactly where the
    run ends on the remote side AND on the local side. The result moves exactly the same
    bytes to the same places, with never more descriptors than the input.

    Inputs must satisfy `check_pairs` (equal pairwise lengths); this function does not
    re-validate. Returns two lists of equal length.
    """
    pairs = sorted(zip(remote, local, strict=True), key=lambda p: (p[0][0], p[1][0]))
    out_remote: list[ByteRange] = []
    out_local: list[ByteRange] = []
    run_r, run_l, run_len = -1, -1, 0
    for (r_addr, length), (l_addr, _) in pairs:
        if run_len and r_addr == run_r + run_len and l_addr == run_l + run_len:
            run_len += length
            continue
        if run_len:
            out_remote.append((run_r, run_len))
            out_local.append((run_l, run_len))
        run_r, run_l, run_len = r_addr, l_addr, length
    if run_len:
        out_remote.append((run_r, run_len))
        out_local.append((run_l, run_len))
    return out_remote, out_local
