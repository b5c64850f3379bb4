"""The block manager of a model with sliding-window layers: two block tables per request over
one pool, the sliding one released outside the window (vLLM's hybrid KV cache manager, with
its SlidingWindowManager's rules; attention/kv_groups.py has the memory layout).

Every request holds `block_ids` (the full-attention layers: every block of the sequence) and
`sliding_block_ids` (the sliding layers), both one entry per `block_size` tokens. Before each
schedule the sliding entries no later query can read (all positions <= computed - window) are
released and become `null_block`, an id outside the pool the block manager hands out. Under
async scheduling a step still in flight may read a block released this way; the step that next
writes the block is queued after it on the same stream, so it reads what it was meant to.

Prefix caching stays exact. Both groups' full blocks are published under the prompt's chained
hashes, the sliding group's under a salted key (a block id can hold either group's layers, so
equal hashes must not name the same block). A hit of k blocks needs the k full blocks and the
sliding blocks a query at position k * block_size reads (the window's blocks before it); a
released sliding block keeps its hash in the free queue and serves hits until it is evicted. When
it was evicted, the hit is shortened to the longest prefix whose window is still held, and the
rest is recomputed. Only the full group's blocks are reported to KV-aware routers (events).

With a host tier (--kv-offloading-size, host_tier_index.py) both groups' hashed blocks go there
when the device evicts them, each under its key (the sliding group's salted, never named by an
event), and a lookup counts a block held in either tier: the full group's blocks of the prefix
(the device's run, then the tier's), and only the window's sliding blocks, each from wherever it
is. A sliding block is kept whether or not it is in some request's last window, as the device
cache keeps it: a hit can end at any block (a shared preamble, an edited turn), and without the
window at that block the rule above shortens it to nothing. The restored blocks are fresh device
blocks, copied back before the step and published as computed ones are.
"""

from __future__ import annotations

from pdserve.worker.attention.kv_groups import KVGroups
from pdserve.worker.engine.block_manager import BlockManager
from pdserve.worker.engine.host_tier_index import UNREPORTED, HostTierIndex, TierCopy
from pdserve.worker.request.request import Request

# XORed into a block hash to key the sliding group's copy of that block (a bijection: distinct
# hashes stay distinct; a full hash equal to a salted one is a 2**-64 accident).
SLIDING_SALT = 0x5D1D_1A5A_11DE_0001


class HostHit(list):
    """The host tier's part of a prefix hit (what lookup_host returns): the full group's slots of
    the blocks after the device's hits, and `sliding`, the window's sliding blocks the device
    lacks: sliding table position -> host slot."""

    sliding: dict[int, int]


class PrefixHit(list):
    """The full group's device hit blocks (what BlockManager.lookup_prefix returns) with the
    sliding group's table for every token of the hit (`sliding`: null_block before the window;
    None where `host` restores the block). `host`: the tier's part, None when the device holds all."""

    sliding: list[int | None]
    host: HostHit | None = None


class HybridBlockManager(BlockManager):
    windowed = True

    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups, enable_prefix_caching: bool = True,
                 on_event=None, eviction_slack: float = 0.0, host_tier: HostTierIndex | None = None):
        """`num_blocks`: the KV cache's blocks; the last one is `null_block`, never handed out."""
        super().__init__(num_blocks - 1, block_size, enable_prefix_caching, on_event, eviction_slack, host_tier)
        self.groups = groups
        self.null_block = num_blocks - 1
        self.sliding_hashed = bytearray(num_blocks - 1)  # 1: the block's hash is a sliding key

    # -- prefix cache -------------------------------------------------------------------------

    def lookup_prefix(self, req: Request) -> PrefixHit:
        full = super().lookup_prefix(req)
        k, bs, tier, hashes = len(full), self.block_size, self.host_tier, req.block_hashes
        if tier is not None:  # the full group's run goes on in the tier where the device's ends
            max_blocks = (req.num_tokens - 1) // bs
            while k < max_blocks and hashes[k] in tier:
                k += 1
        sliding: list[int | None] = []
        while k > 0:
            first = self.groups.first_needed_block(k * bs, bs)
            window = [self.hash_to_block.get(h ^ SLIDING_SALT) for h in hashes[first:k]]
            missing = [i for i, b in enumerate(window)
                       if b is None and (tier is None or hashes[first + i] ^ SLIDING_SALT not in tier)]
            if not missing:
                sliding = [self.null_block] * first + window
                break
            # Every shorter hit whose window still covers that block fails too: below it, retry.
            k = first + missing[-1]
        on_device = min(k, len(full))
        hit = PrefixHit(full[:on_device])
        hit.sliding = sliding
        from_host = [i for i, b in enumerate(sliding) if b is None]
        if k > on_device or from_host:  # locked until the step's copies are taken (take_tier_ops)
            hit.host = HostHit(tier.take(hashes[on_device:k]))
            hit.host.sliding = dict(zip(from_host, tier.take([hashes[i] ^ SLIDING_SALT for i in from_host])))
        return hit

    def lookup_host(self, req: Request, cached: PrefixHit | list[int]) -> list[int]:
        """The tier's part of the hit `lookup_prefix` found (the full group's slots); take_cached
        restores its sliding blocks, `restore` its full ones."""
        host = getattr(cached, "host", None)
        return host if host is not None else []

    def register_computed(self, req: Request, num_tokens: int | None = None) -> None:
        start = req.num_hashed_blocks
        super().register_computed(req, num_tokens)
        for i in range(start, req.num_hashed_blocks):
            b = req.sliding_block_ids[i]
            key = req.block_hashes[i] ^ SLIDING_SALT
            if b != self.null_block and key not in self.hash_to_block and self.block_hash[b] is None:
                self._publish_sliding(b, key)

    def _publish_sliding(self, b: int, key: int) -> None:
        self.hash_to_block[key] = b
        self.block_hash[b] = key
        self.sliding_hashed[b] = 1

    # -- allocation ---------------------------------------------------------------------------

    def can_allocate(self, req: Request, num_tokens: int, cached: PrefixHit | list[int] = (),
                     sliding_from: int = 0) -> bool:
        """`sliding_from`: the sliding table's entries before it stay null (allocate)."""
        host = getattr(cached, "host", None)
        from_host, sliding_from_host = (len(host), len(host.sliding)) if host is not None else (0, 0)
        have, need = len(req.block_ids) + len(cached), self.blocks_needed(num_tokens)
        # The sliding table covers the whole hit (device and host blocks); new ones follow it.
        new = max(0, need - have) + max(0, need - max(have + from_host, sliding_from)) + sliding_from_host
        return new + self._reclaimed(cached) <= self.num_free_blocks

    def _reclaimed(self, cached: PrefixHit | list[int]) -> int:
        """How many of the hit's device blocks sit in the free queue (taking them uses free blocks)."""
        held = list(cached) + [b for b in getattr(cached, "sliding", ()) if b is not None and b != self.null_block]
        return sum(1 for b in held if self.ref_counts[b] == 0)

    def fit_chunk(self, req: Request, start: int, n: int, cached: PrefixHit | list[int] = ()) -> int:
        """The longest chunk <= n from `start` that can_allocate admits (0: none). A prompt's
        sliding blocks are all held while its chunk runs and released after, so a long prompt
        goes through in chunks the free blocks hold rather than waiting for room for all of it."""
        host = getattr(cached, "host", None)
        from_host = len(host) if host is not None else 0
        spare = self.num_free_blocks - self._reclaimed(cached) - from_host - (len(host.sliding) if host else 0)
        blocks = len(req.block_ids) + len(cached) + from_host + max(spare, 0) // 2
        return max(0, min(n, blocks * self.block_size - start))

    def take_cached(self, req: Request, cached: PrefixHit | list[int]) -> None:
        """Take the hit's device blocks; a host part's sliding blocks get fresh blocks and their
        copies back now (its full blocks are `restore`'s, after allocate)."""
        sliding = list(getattr(cached, "sliding", []))
        for b in sliding:
            if b is not None and b != self.null_block:
                self._ref(b)
        super().take_cached(req, cached)  # every device hit referenced before anything is evicted
        host = getattr(cached, "host", None)
        if host is not None and host.sliding:
            positions = sorted(host.sliding)
            for i, b in zip(positions, self._new_blocks(None, len(positions))):
                sliding[i] = b
                self.tier_ops.append(TierCopy(False, b, host.sliding[i]))
                if i < len(cached):  # beyond them, register_computed publishes (restore)
                    self._publish_sliding(b, req.block_hashes[i] ^ SLIDING_SALT)
            self.host_tier.restored_blocks += len(positions)
        req.sliding_block_ids.extend(sliding)
        req.num_released_sliding = sum(1 for b in sliding if b == self.null_block)

    def allocate(self, req: Request, num_tokens: int, sliding_from: int = 0) -> None:
        """`sliding_from`: new sliding entries before it are null, not allocated. A P/D pull writes
        the sliding blocks from the window of its first decode query on (KVLayout.sliding_start);
        the earlier ones would never be written nor read."""
        need = self.blocks_needed(num_tokens)
        if need <= len(req.block_ids):
            return
        super().allocate(req, num_tokens)
        table = req.sliding_block_ids
        nulls = max(0, min(sliding_from, need) - len(table))
        table.extend([self.null_block] * nulls)
        last = table[-1] if table else self.null_block
        table.extend(self._new_blocks(last + 1 if last != self.null_block else None, need - len(table)))

    def release_outside_window(self, req: Request) -> int:
        """Release `req`'s sliding blocks that no query from its next token on reads; how many."""
        upto = min(self.groups.first_needed_block(req.num_computed_tokens, self.block_size),
                   len(req.sliding_block_ids))
        table, start = req.sliding_block_ids, req.num_released_sliding
        if upto <= start:
            return 0
        out = [b for b in table[start:upto] if b != self.null_block]
        table[start:upto] = [self.null_block] * (upto - start)
        req.num_released_sliding = upto
        self._release(out)
        return len(out)

    def free_request(self, req: Request) -> None:
        self._release([b for b in req.sliding_block_ids if b != self.null_block])
        req.sliding_block_ids = []
        req.num_released_sliding = 0
        super().free_request(req)

    def _evict(self, b: int) -> None:
        if self.sliding_hashed[b]:  # not a block routers know of: no event
            self.sliding_hashed[b] = 0
            key = self.block_hash[b]
            del self.hash_to_block[key]
            self.block_hash[b] = None
            if self.host_tier is not None:
                self._store(b, key, UNREPORTED)
            return
        super()._evict(b)
