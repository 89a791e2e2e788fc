"""`common.server.role.freeze_startup_heap`: what a role loaded before serving leaves the
garbage collector's generations, so a full collection no longer walks it."""

from __future__ import annotations

import gc

from common.server.role import freeze_startup_heap


def test_objects_alive_at_startup_are_frozen_and_garbage_is_not() -> None:
    gc.unfreeze()
    loaded = [{"weights": [k]} for k in range(2000)]  # stands for a model's Python objects
    cycle: list[object] = []
    cycle.append(cycle)  # unreachable once dropped: collected, never frozen
    del cycle
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= 2 * len(loaded)  # each dict and its list
        assert gc.collect() == 0  # the cycle went before the freeze
        assert all(gc.is_tracked(obj) for obj in loaded[:10])  # still real objects
    finally:
        gc.unfreeze()  # this test process keeps collecting as before
    assert gc.get_freeze_count() == 0
