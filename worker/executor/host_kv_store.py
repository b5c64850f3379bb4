"""The host KV tier's memory, runner side: a slot per offloaded block, and the copies in and out.

The scheduler decides which block goes to which slot and back (engine/host_tier_index.py); each
runner (every tensor-parallel rank, with its own shard of every block) carries the copies out
before the step's forward, in the order given. The cache is block-major (attention/kv_cache.py),
so a block, all its layers, is one contiguous span: a copy moves the raw bytes of that span,
whatever they hold (K and V, an MLA latent, FP8 values: the scales are per layer, not per block).

On CUDA the slots are pinned and the copies run on a side stream, asynchronously: it first waits
for the compute stream (a block evicted now may still be written by a step queued before; a
restore's destination may still be read by one). The step's forward then waits only for the
copies it needs (TierCopy.wait: stores of blocks it reuses, queued first), through an event; the
others (restores for requests the scheduler held out of this step, stores ahead of eviction)
overlap the forward, and the next step's forward waits for their event (`settle`): by then the
requests restored may run and the blocks stored ahead may be reused. The side stream runs its
copies in order, so one event covers every copy queued before it. On CPU the slots are plain
tensors and the copies synchronous (waited ones first, as on CUDA): the same code, so CI runs it.
"""

from __future__ import annotations

import logging
import os

import torch

from pdserve.protocol.flags import ConfigError

log = logging.getLogger(__name__)

GIB = 2**30
# Host memory left to everything else when the tier is checked against what the host has.
HOST_HEADROOM = 0.9


def host_tier_slots(size_gib: float, block_bytes: int, tp_size: int = 1) -> int:
    """How many blocks --kv-offloading-size holds: the size is the sum over the tensor-parallel
    ranks (vLLM's meaning), each rank holding its shard of every block (`block_bytes`)."""
    slots = int(size_gib * GIB) // (block_bytes * tp_size)
    if slots < 1:
        raise ConfigError("--kv-offloading-size", f"{size_gib} GiB holds no KV block ({block_bytes * tp_size} "
                                                  f"bytes each); give it more or 0 to turn the tier off")
    return slots


def available_host_bytes() -> int:
    """Memory the host can still give (MemAvailable; the physical pages where that is unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class HostKVStore:
    def __init__(self, cache: torch.Tensor, num_slots: int, size_gib: float):
        """`cache`: the device KV cache tensor, [num_blocks, ...] block-major."""
        self.cache = cache
        nbytes = num_slots * cache[0].numel() * cache.element_size()
        available = available_host_bytes()
        if nbytes > HOST_HEADROOM * available:
            raise ConfigError("--kv-offloading-size", f"{size_gib} GiB ({nbytes / GIB:.1f} GiB on this rank) is "
                                                      f"more than this host can hold ({available / GIB:.1f} GiB "
                                                      f"available); lower it")
        self.device = cache.device
        pin = self.device.type == "cuda"
        try:
            self.slots = torch.empty((num_slots, *cache.shape[1:]), dtype=cache.dtype, pin_memory=pin)
        except RuntimeError as e:  # pinning can fail below MemAvailable (locked-memory limits)
            raise ConfigError("--kv-offloading-size", f"{size_gib} GiB of {'pinned ' if pin else ''}host memory "
                                                      f"could not be allocated ({e}); lower it") from None
        self._stream = torch.cuda.Stream(self.device) if pin else None
        # The copies no forward has waited for yet (CUDA): the next forward waits for this event.
        self._pending: torch.cuda.Event | None = None
        self._last: torch.cuda.Event | None = None  # the last copy queued, waited for or not
        self.bytes_stored = 0
        self.bytes_restored = 0
        log.info("host KV tier: %d blocks, %.2f GiB%s", num_slots, nbytes / GIB, " pinned" if pin else "")

    @property
    def block_bytes(self) -> int:
        return self.slots[0].numel() * self.slots.element_size()

    @property
    def pending(self) -> bool:
        """Copies may still be running on the device (a P/D pull must not start first): the host
        asks the last one's event; a forward waiting for them on the device does not tell it."""
        return self._pending is not None or (self._last is not None and not self._last.query())

    def apply(self, ops) -> None:
        """Before a step's forward: wait for the copies earlier steps left running, then carry out
        `ops` (TierCopy: out = device block -> host slot, else back), those the forward waits for
        first, the rest in their order after them, overlapping the forward."""
        self.settle()
        if not ops:
            return
        # Waited-for copies are stores of blocks evicted now (and a hybrid cache's window restores,
        # published at once); moving them ahead of the others, in their own order, is safe: a
        # block is evicted (its store queued) before it is handed out fresh to be restored into,
        # and a restore's source slot is locked against stores until the step's copies are taken.
        now = [op for op in ops if op.wait]
        later = [op for op in ops if not op.wait]
        if self._stream is None:
            self._copy(now + later, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            self._copy(now, non_blocking=True)
            if now:
                compute.wait_event(self._record())
            if later:
                self._copy(later, non_blocking=True)
                self._pending = self._record()

    def settle(self) -> None:
        """The compute stream waits (on the device) for every copy queued so far."""
        if self._pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending)
            self._pending = None

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream)
        self._last = event
        return event

    def _copy(self, ops, non_blocking: bool) -> None:
        for op in ops:
            if op.out:
                self.slots[op.slot].copy_(self.cache[op.block], non_blocking=non_blocking)
                self.bytes_stored += self.block_bytes
            else:
                self.cache[op.block].copy_(self.slots[op.slot], non_blocking=non_blocking)
                self.bytes_restored += self.block_bytes
