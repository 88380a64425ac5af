"""A serving process's start-up heap frozen out of the collector's collections
(`engine.gc_heap`), and what is made afterwards collected as before."""

from __future__ import annotations

import gc

from engine.gc_heap import freeze_startup_heap


def test_the_startup_heap_freezes_out_of_collections() -> None:
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000  # torch, the modules, the tests
        cycle: list[object] = []
        cycle.append(cycle)  # garbage made after the freeze is collected as before
        del cycle
        assert gc.collect() >= 1 and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
