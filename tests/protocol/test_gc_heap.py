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
