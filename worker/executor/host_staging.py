"""Persistent host buffers for a step's small copies between host and device.

A decode step moves a few hundred bytes each way: its inputs up, its sampled token ids down.
Allocating a host tensor for each, every step, costs host time that the GPU then waits for;
copying from pageable memory also makes the "asynchronous" copy wait for the host. These
buffers are allocated once, pinned on CUDA (so copies really are asynchronous), and used in
rotation: with async scheduling one step's copy may still be queued on the stream while the
host fills the next step's buffer, so each slot remembers the event of the copy that last
read (or wrote) it, and is only reused once that event has passed. Two slots suffice: the
engine keeps at most one step in flight while it prepares the next.

On CPU there is nothing to pin and copies are synchronous; the same code runs, the events are
None.
"""

from __future__ import annotations

import torch


class HostStaging:
    def __init__(self, layout: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device, slots: int = 2):
        """`layout`: the (shape, dtype) of each buffer a slot holds (a step's copies share a slot)."""
        pin = device.type == "cuda"
        self._buffers = [[torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in layout]
                         for _ in range(slots)]
        # numpy views of the same memory: filling them from Python lists allocates no tensor.
        self._arrays = [[b.numpy() for b in bufs] for bufs in self._buffers]
        # One event per slot, made once and re-recorded (recording an event allocates nothing).
        self._events = [torch.cuda.Event() for _ in range(slots)] if pin else None
        self._queued = [False] * slots
        self._next = 0

    def acquire(self) -> tuple[int, list[torch.Tensor], list]:
        """A free slot, its host buffers and their numpy views (waits only if that slot's last
        copy is still queued)."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        if self._queued[i]:
            self._events[i].synchronize()
            self._queued[i] = False
        return i, self._buffers[i], self._arrays[i]

    def record(self, slot: int) -> torch.cuda.Event | None:
        """Mark the copy just queued on the current stream as the slot's last user; returns its event."""
        if self._events is None:
            return None
        event = self._events[slot]
        event.record()
        self._queued[slot] = True
        return event
