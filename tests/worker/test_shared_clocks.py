"""shared_clocks: a LayerClock's count read through the shared ring, as the TCP senders' child
reads it (here in one process: the ring's cells are the same shared memory either way)."""

from __future__ import annotations

import threading

import torch

from pdserve.worker.kv import shared_clocks
from pdserve.worker.kv.layer_clock import LayerClock
from pdserve.worker.kv.shared_clocks import ClockMirrors, ClockRing

CPU = torch.device("cpu")


def test_a_mirror_follows_its_clock_and_waits_for_a_layer():
    ring = ClockRing(4, CPU)
    mirrors = ClockMirrors(ring.share())
    clock = LayerClock(4, CPU, ring)
    mirror = mirrors.get(*clock.shared)
    assert mirror.done() == 0 and not mirror.wait(1, 0.01)  # nothing launched: the wait gives up
    clock.after_layer(0)
    clock.after_layer(1)
    assert mirror.done() == 2 and mirror.wait(2, 0.01)
    later = threading.Timer(0.05, lambda: (clock.after_layer(2), clock.after_layer(3)))
    later.start()
    assert mirror.wait(4, 5.0) and mirror.done() == 4  # woken by the count, no message
    later.join()


def test_a_slot_taken_by_a_later_clock_counts_as_written():
    """A slot is reused SLOTS clocks later, when its step is long collected: every layer written."""
    ring = ClockRing(4, CPU)
    mirrors = ClockMirrors(ring.share())
    old = LayerClock(4, CPU, ring)
    mirror = mirrors.get(*old.shared)
    later = [LayerClock(4, CPU, ring) for _ in range(shared_clocks.SLOTS)]
    reuse = later[-1]
    assert reuse.shared[0] == old.shared[0] and reuse.shared[1] != old.shared[1]
    assert mirror.done() == 4 and mirror.wait(4, 0.01)
    assert mirrors.get(*reuse.shared).done() == 0  # the slot's new clock starts from nothing


def test_a_clock_of_other_layers_than_the_ring_is_not_shared():
    """(A hybrid cache's layer count differs from the model's): its blocks then wait for collection."""
    assert LayerClock(6, CPU, ClockRing(4, CPU)).shared is None
    assert LayerClock(4, CPU, None).shared is None
