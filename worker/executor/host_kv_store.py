"""The host KV tier's memory, runner side: a slot per offloaded block, and the copies in and out.

The scheduler decides which block goes to which slot and back (engine/host_tier_index.py); each
runner (every tensor-parallel rank, with its own shard of every block) carries the copies out
before the step's forward, in the order given. The cache is block-major (attention/kv_cache.py),
so a block, all its layers, is one contiguous span: a copy moves the raw bytes of that span,
whatever they hold (K and V, an MLA latent, FP8 values: the scales are per layer, not per block).

On CUDA the slots are pinned and the copies run on a side stream: it first waits for the compute
stream (a block evicted now may still be written by a step queued before; a restore's destination
may still be read by one), and the compute stream waits for it before the next forward (a store
must read the block before anything overwrites it; a restore must land before it is read). The
copies themselves stay off the host's critical path (asynchronous, pinned memory). On CPU the
slots are plain tensors and the copies synchronous: the same code, so CI runs it.
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
        self.bytes_stored = 0
        self.bytes_restored = 0
        log.info("host KV tier: %d blocks, %.2f GiB%s", num_slots, nbytes / GIB, " pinned" if pin else "")

    @property
    def block_bytes(self) -> int:
        return self.slots[0].numel() * self.slots.element_size()

    def apply(self, ops) -> None:
        """Carry out `ops` (TierCopy: out = device block -> host slot, else back) in order."""
        if not ops:
            return
        if self._stream is None:
            self._copy(ops, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            self._copy(ops, non_blocking=True)
        compute.wait_stream(self._stream)

    def _copy(self, ops, non_blocking: bool) -> None:
        for op in ops:
            if op.out:
                self.slots[op.slot].copy_(self.cache[op.block], non_blocking=non_blocking)
                self.bytes_stored += self.block_bytes
            else:
                self.cache[op.block].copy_(self.slots[op.slot], non_blocking=non_blocking)
                self.bytes_restored += self.block_bytes
