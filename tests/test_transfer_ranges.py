"""NIXL transfer layer, pure range merging: `merge_ranges` joins pairs adjacent on both
sides (ordering them by remote address first) without moving a byte and leaves no two
neighbours it could still merge, the numpy path agrees with the list path, and `check_pairs`
refuses plans with unequal counts, nothing to copy, unequal or empty lengths, or overlaps.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.transfer.ranges import check_pairs, merge_ranges


def test_merge_adjacent_both_sides() -> None:
    remote = [(1000, 10), (1010, 10), (1020, 5), (2000, 10)]
    local = [(0, 10), (10, 10), (40, 5), (45, 10)]
    assert merge_ranges(remote, local) == (
        [(1000, 20), (1020, 5), (2000, 10)],
        [(0, 20), (40, 5), (45, 10)],
    )


def test_merge_orders_pairs_by_remote_address() -> None:
    # Blocks 5, 3, 4 into local slots 2, 0, 1: one run once ordered.
    remote = [(500, 100), (300, 100), (400, 100)]
    local = [(200, 100), (0, 100), (100, 100)]
    assert merge_ranges(remote, local) == ([(300, 300)], [(0, 300)])


@pytest.mark.parametrize(
    ("remote", "local", "message"),
    [
        ([(0, 8)], [], "same number"),
        ([], [], "nothing to transfer"),
        ([(0, 8)], [(100, 4)], "differs"),
        ([(0, 0)], [(100, 0)], "positive"),
        ([(0, 8), (8, 8)], [(100, 8), (104, 8)], "overlap"),
    ],
)
def test_check_pairs_rejects(remote: list, local: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_pairs(remote, local)


@st.composite
def copy_plans(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Random valid copies: disjoint local ranges, remote ranges often adjacent."""
    n = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    local_gaps = draw(st.lists(st.sampled_from([0, 0, 0, 3]), min_size=n, max_size=n))
    remote_jumps = draw(st.lists(st.sampled_from([0, 0, 0, 2, -9]), min_size=n, max_size=n))
    local, remote = [], []
    l_addr, r_addr = 0, 50
    for length, gap, jump in zip(lengths, local_gaps, remote_jumps, strict=True):
        l_addr += gap
        r_addr = max(0, r_addr + jump)
        local.append((l_addr, length))
        remote.append((r_addr, length))
        l_addr += length
        r_addr += length
    order = draw(st.permutations(range(n)))
    return [remote[i] for i in order], [local[i] for i in order]


def _byte_map(remote: list[tuple[int, int]], local: list[tuple[int, int]]) -> set:
    return {
        (r + k, dst + k)
        for (r, length), (dst, _) in zip(remote, local, strict=True)
        for k in range(length)
    }


@settings(max_examples=200, deadline=None)
@given(copy_plans())
def test_merge_preserves_bytes_and_never_grows(plan: tuple[list, list]) -> None:
    remote, local = plan
    check_pairs(remote, local)
    m_remote, m_local = merge_ranges(remote, local)
    check_pairs(m_remote, m_local)
    assert len(m_remote) <= len(remote)
    assert _byte_map(m_remote, m_local) == _byte_map(remote, local)
    # The numpy implementation (used for large reads) gives the same result.
    assert merge_ranges(np.array(remote), np.array(local)) == (m_remote, m_local)
    # Maximal: no two neighbouring output pairs could be merged further.
    for (ra, la), (rb, lb) in zip(
        zip(m_remote, m_local, strict=True),
        zip(m_remote[1:], m_local[1:], strict=False),
        strict=False,
    ):
        assert not (ra[0] + ra[1] == rb[0] and la[0] + la[1] == lb[0])
