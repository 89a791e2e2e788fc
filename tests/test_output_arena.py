"""The encoder's output arena: the first-fit, coalescing byte-range allocator (pure), and the
arena's views of its buffer."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_worker.arena import ALIGN, OutputArena, RangeAllocator


def test_ranges_are_aligned_and_first_fit() -> None:
    a = RangeAllocator(1024, align=64)
    assert [a.allocate(n) for n in (1, 64, 65, 200)] == [0, 64, 128, 256]
    assert a.used_bytes == 64 + 64 + 128 + 256 and len(a) == 4
    a.free(64)
    # The hole at 64 is the lowest that fits 64 bytes; 65 bytes do not fit it.
    assert a.allocate(65) == 512
    assert a.allocate(10) == 64
    assert a.free_ranges() == [(640, 1024)]


def test_capacity_rounds_down_and_full_arena_says_none() -> None:
    a = RangeAllocator(1000, align=64)
    assert a.capacity == 960
    assert a.allocate(960) == 0
    assert a.allocate(1) is None
    assert a.largest_free == 0 and a.free_bytes == 0
    assert RangeAllocator(0).allocate(1) is None


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (0, 2, 1), (1, 0, 2), (1, 2, 0)])
def test_freed_neighbours_coalesce(order: tuple[int, ...]) -> None:
    a = RangeAllocator(64 * 4, align=64)
    offsets = [a.allocate(64) for _ in range(3)]
    assert offsets == [0, 64, 128]
    for i in order:
        a.free(offsets[i])  # type: ignore[arg-type]
    assert a.free_ranges() == [(0, 256)]
    assert a.allocate(256) == 0


def test_middle_free_merges_both_sides() -> None:
    a = RangeAllocator(64 * 5, align=64)
    offsets = [a.allocate(64) for _ in range(5)]
    a.free(64)
    a.free(192)
    assert a.free_ranges() == [(64, 128), (192, 256)]
    a.free(128)
    assert a.free_ranges() == [(64, 256)]
    assert offsets[0] == 0 and a.allocate(192) == 64


def test_bad_arguments_and_double_free_are_refused() -> None:
    a = RangeAllocator(256)
    with pytest.raises(ValueError, match="power of two"):
        RangeAllocator(256, align=48)
    with pytest.raises(ValueError, match="positive"):
        a.allocate(0)
    offset = a.allocate(10)
    assert offset == 0
    a.free(offset)
    with pytest.raises(ValueError, match="no live range"):
        a.free(offset)
    with pytest.raises(ValueError, match="no live range"):
        a.free(64)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(1, 700)),
            st.tuples(st.just("free"), st.integers(0, 1 << 16)),
        ),
        max_size=80,
    ),
    capacity=st.integers(0, 4096),
)
def test_allocations_never_overlap_and_everything_coalesces(
    ops: list[tuple[str, int]], capacity: int
) -> None:
    a = RangeAllocator(capacity, align=ALIGN)
    live: dict[int, int] = {}  # offset -> bytes asked
    for op, n in ops:
        if op == "alloc":
            offset = a.allocate(n)
            if offset is None:
                assert a.largest_free < n
                continue
            assert offset % ALIGN == 0 and offset + n <= a.capacity
            live[offset] = n
        elif live:
            offset = sorted(live)[n % len(live)]
            del live[offset]
            a.free(offset)
        spans = sorted((o, o + -(-n // ALIGN) * ALIGN) for o, n in live.items())
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
        free = a.free_ranges()
        assert all(end < nxt for (_, end), (nxt, _) in itertools.pairwise(free))
        assert a.used_bytes == sum(end - start for start, end in spans)
        assert len(a) == len(live)
    for offset in list(live):
        a.free(offset)
    assert a.free_ranges() == ([(0, a.capacity)] if a.capacity else [])
    assert a.used_bytes == 0


def test_arena_views_are_its_buffer() -> None:
    arena = OutputArena(4096 + 10, "cpu")
    assert arena.buffer.numel() == 4096 and arena.buffer.dtype == torch.uint8
    offset = arena.allocate(100)
    assert offset == 0
    view = arena.view(offset, 100)
    view.fill_(7)
    assert arena.buffer.data_ptr() == view.data_ptr()
    assert int(arena.buffer[:100].sum()) == 700
    assert arena.allocate(100) == 128
    arena.free(offset)
    assert arena.allocate(64) == 0
