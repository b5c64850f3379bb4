"""The host KV tier's bookkeeping, scheduler side: which block hashes sit in which host slot.

The tier (--kv-offloading-size) is a second, larger and slower prefix cache behind the device
one. A hashed block that the device cache evicts is copied into a host slot under the same hash
(a store); a prefix lookup that runs out of device hits continues here, and each host hit is
copied back into a freshly allocated device block (a restore) before the step that reads it.
The scheduler decides every copy; the model runners (every tensor-parallel rank, its own shard)
only carry them out, in the order decided (executor/host_kv_store.py).

Slots are LRU: a store takes a free slot, else the least recently used one (stored or restored).
A restore's source slot is locked from its lookup until its copy is ordered, so a store made by
the same allocation (an eviction to make room) never overwrites it first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class TierCopy:
    """One block copy between the tiers: device block `block` to host slot `slot` (out=True,
    a store) or back (a restore). `wait`: the forward of the step that carries it waits for it
    (a store of a block that step reuses); else it overlaps that forward and the next step's
    forward waits for it (a restore for a request held out of this step, a store ahead of the
    block's eviction)."""

    out: bool
    block: int
    slot: int
    wait: bool = True


@dataclass(frozen=True)
class HostBlock:
    """What a KV event about a host-tier block names: its chain parent and tokens (and adapter)."""

    parent: int | None
    token_ids: tuple[int, ...]
    lora_name: str | None


# What a block no KV event names is stored under: a hybrid cache's sliding-group block (its key is
# a salted hash routers never saw), stored and dropped silently.
UNREPORTED = HostBlock(None, (), None)


class HostTierIndex:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self.block_of: dict[int, HostBlock] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._locked: set[int] = set()  # hashes a restore ordered this schedule reads
        # Counters: blocks stored, blocks restored, blocks dropped from the tier by its LRU.
        self.stored_blocks = 0
        self.restored_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, h: int) -> bool:
        return h in self.slot_of

    def store(self, h: int, block: HostBlock) -> tuple[int | None, int | None]:
        """Give hash `h` a slot. Returns (slot, hash evicted to make room): slot None when `h`
        is already held (made most recent, nothing to copy) or every slot is locked. The evicted
        hash is None where its block is UNREPORTED (no event may name it)."""
        if h in self.slot_of:
            self.slot_of.move_to_end(h)
            return None, None
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next((old for old in self.slot_of if old not in self._locked), None)
            if evicted is None:
                return None, None
            slot = self.slot_of.pop(evicted)
            if self.block_of.pop(evicted) is UNREPORTED:
                evicted = None
            self.evicted_blocks += 1
        self.slot_of[h] = slot
        self.block_of[h] = block
        self.stored_blocks += 1
        return slot, evicted

    def lookup(self, hashes: list[int]) -> list[int]:
        """The slots of the longest run of `hashes` held here, from the first; locked until
        `unlock_all` (a restore will read them) and made most recent."""
        run = 0
        while run < len(hashes) and hashes[run] in self.slot_of:
            run += 1
        return self.take(hashes[:run])

    def take(self, hashes: list[int]) -> list[int]:
        """The slots of `hashes`, every one held here; locked until `unlock_all` and made most recent."""
        slots = []
        for h in hashes:
            self.slot_of.move_to_end(h)
            self._locked.add(h)
            slots.append(self.slot_of[h])
        return slots

    def unlock_all(self) -> None:
        self._locked.clear()
