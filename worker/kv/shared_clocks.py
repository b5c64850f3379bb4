"""Layer clocks another process can read: how far a launched prefill step has written its KV.

The TCP senders may run in a process of their own (tcp_sender_process.py), away from the
engine's interpreter; a layered stream read there still needs to know, as the step thread's
layer_clock.LayerClock knows, how many layers a launched step's forward has written. Here:

- `ClockRing` (engine side): SLOTS cells in shared memory, each [generation, layers launched].
  A LayerClock made with the ring claims the next slot (a new generation) and, at each
  `after_layer`, writes the layers launched so far: a store into shared memory, no message, no
  lock another process could hold. On CUDA each (slot, layer) also has an interprocess event,
  recorded on the compute stream before the count is written.
- `ClockMirror` (senders' side): a clock named by (slot, generation). Layers written = the
  count on the CPU (the forward ran them as it queued them); on CUDA the leading events that
  have completed, among those launched. A slot whose generation moved on belonged to a step
  SLOTS clocks ago: long collected, every layer written.
"""

from __future__ import annotations

import threading
import time

import torch

SLOTS = 32  # launched steps at once are at most 2 (async scheduling); the rest is margin for readers
POLL_S = 0.0005  # a mirror waiting for a layer to be launched looks this often (no wake-up crosses processes)


class ClockRing:
    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.cells = torch.zeros(SLOTS, 2, dtype=torch.int64).share_memory_()
        self._cells = self.cells.numpy()  # element stores: ~100 ns, no torch dispatch
        self._cuda = device.type == "cuda"
        self._device = device
        self.events = ([[torch.cuda.Event(blocking=True, interprocess=True) for _ in range(num_layers)]
                        for _ in range(SLOTS)] if self._cuda else None)
        self._generation = 0
        self._lock = threading.Lock()

    def claim(self) -> tuple[int, int]:
        """(slot, generation) of a new clock; its count starts at 0."""
        with self._lock:
            self._generation += 1
            gen = self._generation
        slot = gen % SLOTS
        self._cells[slot, 1] = 0
        self._cells[slot, 0] = gen
        return slot, gen

    def event(self, slot: int, layer: int):
        return self.events[slot][layer]

    def mark(self, slot: int, launched: int) -> None:
        self._cells[slot, 1] = launched

    def share(self) -> tuple:
        """What another process needs to read the ring: the cells (pickled as shared memory),
        the events' IPC handles (CUDA) and the device."""
        handles = None
        if self._cuda:
            with torch.cuda.device(self._device):
                handles = [[e.ipc_handle() for e in row] for row in self.events]
        return self.cells, handles, str(self._device)


class ClockMirrors:
    """Senders' side: the ring of `ClockRing.share()`, and a mirror per (slot, generation) asked for."""

    def __init__(self, shared: tuple):
        cells, handles, device = shared
        self._cells = cells.numpy()
        self._keep = cells  # the shared storage lives as long as its numpy view is used
        self._events = None
        if handles is not None:
            dev = torch.device(device)
            self._events = [[torch.cuda.Event.from_ipc_handle(dev, h) for h in row] for row in handles]
        self._mirrors: dict[tuple[int, int], ClockMirror] = {}
        self._lock = threading.Lock()

    def get(self, slot: int, gen: int, num_layers: int) -> "ClockMirror":
        with self._lock:
            m = self._mirrors.get((slot, gen))
            if m is None:
                for key in [k for k in self._mirrors if k[0] == slot]:  # the slot's older clock is over
                    del self._mirrors[key]
                m = self._mirrors[(slot, gen)] = ClockMirror(self._cells, self._events, slot, gen, num_layers)
            return m


class ClockMirror:
    """A LayerClock of the engine, read from another process (done / wait, as LayerClock's)."""

    def __init__(self, cells, events, slot: int, gen: int, num_layers: int):
        self._cells, self._events, self.slot, self.gen = cells, events, slot, gen
        self.num_layers = num_layers
        self._done = 0
        self._lock = threading.Lock()

    def _launched(self) -> int | None:
        """Layers the forward has launched, None once the slot holds a later clock."""
        if int(self._cells[self.slot, 0]) != self.gen:
            return None
        launched = int(self._cells[self.slot, 1])
        return launched if int(self._cells[self.slot, 0]) == self.gen else None

    def done(self) -> int:
        """How many leading layers are written now (never blocks)."""
        launched = self._launched()
        if launched is None:
            return self.num_layers
        if self._events is None:
            return launched
        with self._lock:
            row = self._events[self.slot]
            while self._done < launched and row[self._done].query():
                self._done += 1
            return self._done

    def wait(self, n: int, timeout_s: float) -> bool:
        """Until the first `n` layers are written (True); at most about `timeout_s` for the
        forward to launch them (a launched layer is then waited for without a bound)."""
        deadline = time.monotonic() + timeout_s
        while True:
            launched = self._launched()
            if launched is None:
                return True
            if launched >= n:
                break
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        if self._events is not None:
            self._events[self.slot][n - 1].synchronize()
        return True
