"""A serving process settles its heap once started: what startup built is out of the collector's way."""

from __future__ import annotations

import gc

from kvflow.heap import GC_THRESHOLD, settle_heap


def test_settling_freezes_what_startup_built_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    built_at_startup = [[i] for i in range(1000)]  # lists: always tracked by the collector
    try:
        gc.collect()
        assert any(o is built_at_startup[0] for o in gc.get_objects(generation=2))  # old: every full collection walks it

        settle_heap()

        assert gc.get_freeze_count() >= len(built_at_startup)  # survivors are frozen, never walked again
        assert gc.get_threshold() == (GC_THRESHOLD, 20, 20)
        assert not any(o is built_at_startup[0] for o in gc.get_objects(generation=2))  # frozen: in no generation
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
