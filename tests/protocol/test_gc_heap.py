"""protocol/gc_heap.py: what exists when a server is ready is out of the collector's reach."""

from __future__ import annotations

import gc

from pdserve.protocol.gc_heap import freeze_startup_heap


def test_the_startup_heap_is_frozen():
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the test process's heap goes back to the collector


def test_a_young_threshold_is_set_and_the_older_generations_keep_theirs():
    before = gc.get_threshold()
    try:
        freeze_startup_heap(young_threshold=before[0] * 10)
        assert gc.get_threshold() == (before[0] * 10, *before[1:])
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
