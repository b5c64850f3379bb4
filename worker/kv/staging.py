"""Staging buffers for KV reads whose blocks are not ours: registered once, reused, never shared.

A decode rank reading a tensor-parallel peer of another TP size gets whole remote blocks that
hold other heads than its own (tp_transfer.py): they land in a staging buffer, then one indexed
copy scatters the heads it keeps into its cache. NIXL can only READ into registered memory, and
registering VRAM costs milliseconds (a per-pull registration made an H100's 2 -> 1 pulls ~4x
slower than 1 -> 1), so the buffers here are registered once and reused:

- A pull takes one slot for its reads and its scatter and gives it back after; a slot belongs
  to one pull at a time, so concurrent pulls (the pull pool runs several) never share bytes.
  Slots are made on demand, at most `max_slots`; a pull that finds every slot taken waits for
  one (for at most its timeout).
- A slot grows (freed, reallocated, registered again) only when a pull needs more than it
  holds: to at least twice its size and at least `floor`, at most `cap`. The caller splits a pull
  bigger than `cap` into chunks that fit (`blocks_per_chunk`), so the resident staging memory is
  at most `max_slots x cap` whatever the prompt length.
- A slot a READ may still be writing into (its wait timed out) is retired: never handed out
  again, kept alive (and registered) until close(), so no later allocation reuses its memory.
- On CUDA each slot has its own stream for the scatter, synchronized before the slot is given
  back (a READ of the next pull must not overwrite bytes a queued copy has yet to read), without
  waiting on the engine's own kernels on the default stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import torch

MAX_SLOTS = 4  # concurrent staged pulls per rank; more wait for a slot
MAX_SLOT_BYTES = 256 << 20  # a slot's cap: a 1B Llama's 8K-token prompt; longer pulls go in chunks
MIN_SLOT_BYTES = 64 << 20  # a first slot's size: most prompts fit without growing it
CACHE_FRACTION = 16  # ... and a slot never exceeds 1/16 of this rank's KV cache


class StagingBusy(RuntimeError):
    """Every slot stayed taken for the pull's whole timeout (the request prefills locally)."""


@dataclasses.dataclass
class Slot:
    data: torch.Tensor | None = None  # [capacity] uint8
    reg: object = None  # what `register` returned for `data`
    stream: object = None  # CUDA only: the stream its scatter runs on
    retire: bool = False  # set by the user: a READ may still write here

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.numel()


def slot_cap(cache: torch.Tensor) -> int:
    return min(MAX_SLOT_BYTES, cache.numel() * cache.element_size() // CACHE_FRACTION)


class StagingPool:
    def __init__(self, device: torch.device, cap: int, register, deregister, max_slots: int = MAX_SLOTS):
        """`register(tensor) -> handle` and `deregister(handle)` tell the transport (NIXL) about a buffer."""
        self.device, self.cap, self.max_slots = device, cap, max_slots
        self.floor = min(cap, MIN_SLOT_BYTES)
        self._register, self._deregister = register, deregister
        self._cond = threading.Condition()
        self._free: list[Slot] = []
        self._made = 0  # slots in use or free (not retired)
        self._retired: list[Slot] = []
        self._closed = False
        self.registrations = 0  # buffers registered so far (tests and benchmarks read it)
        self.registered = 0  # buffers registered now

    def blocks_per_chunk(self, bytes_per_block: int) -> int:
        """How many blocks of `bytes_per_block` staged bytes one slot takes (at least one)."""
        return max(1, self.cap // bytes_per_block)

    @contextlib.contextmanager
    def take(self, nbytes: int, timeout_s: float):
        """A slot of at least `nbytes`, this caller's alone until the block exits."""
        slot = self._acquire(timeout_s)
        try:
            if slot.capacity < nbytes:
                self._grow(slot, nbytes)
            yield slot
        finally:
            self._give_back(slot)

    def close(self) -> None:
        """Deregister and free every slot (the connector shuts down; no pull runs any more)."""
        with self._cond:
            self._closed = True
            slots, self._free, self._retired = self._free + self._retired, [], []
            self._made = 0
            self._cond.notify_all()
        for slot in slots:
            self._free_slot(slot)

    # -- internals ---------------------------------------------------------------------------------

    def _acquire(self, timeout_s: float) -> Slot:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise StagingBusy("the KV connector is shutting down")
                if self._free:
                    return self._free.pop()
                if self._made < self.max_slots:
                    self._made += 1
                    return Slot(stream=torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingBusy(f"all {self.max_slots} KV staging buffers stayed in use for {timeout_s}s")
                self._cond.wait(left)

    def _grow(self, slot: Slot, nbytes: int) -> None:
        size = max(nbytes, min(self.cap, max(2 * slot.capacity, self.floor)))
        self._free_slot(slot)
        data = torch.empty(size, dtype=torch.uint8, device=self.device)
        slot.reg, slot.data = self._register(data), data  # if registering fails the slot stays empty
        with self._cond:
            self.registrations += 1
            self.registered += 1

    def _free_slot(self, slot: Slot) -> None:
        if slot.reg is not None:
            reg, slot.reg = slot.reg, None
            self._deregister(reg)  # before the memory goes back to the allocator
            with self._cond:
                self.registered -= 1
        slot.data = None

    def _give_back(self, slot: Slot) -> None:
        with self._cond:
            if self._closed:
                late = True
            elif slot.retire:
                self._retired.append(slot)
                self._made -= 1  # a fresh slot may replace it
                late = False
            else:
                self._free.append(slot)
                late = False
            self._cond.notify()
        if late:  # close() ran while this pull held the slot
            self._free_slot(slot)
