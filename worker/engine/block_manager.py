"""KV block allocation with hash-chained prefix caching.

A full block's hash covers its tokens and, through its parent's hash, every token before it,
so equal hashes mean equal prefixes. Freed blocks keep their contents and hash and sit in an
LRU free queue: a later request with the same prefix takes them back (a prefix-cache hit)
until the allocator reuses them for something else (eviction). A block is therefore free
(ref_count 0) and possibly cached at the same time; "free blocks" counts both.

Free blocks live in two pools. Empty ones (no published hash) cost nothing to reuse and are
taken first, as runs of consecutive ids: a request whose blocks are consecutive ids is a few
large spans of the block-major KV cache (kv_cache.py), so a KV transfer moves it with a few
descriptors rather than one per block (issue 17: per-descriptor cost dominated scattered
pulls). They are kept as maximal runs (free_runs.py): a request takes the ids right after its
last block first (a growing request stays one run), then the shortest run that holds the rest,
else the longest runs whole; no allocation scans the cache. Cached ones are evicted only when
no empty block is left. By default strictly least recently freed first, and which cached blocks
go is never bent for contiguity, only the order they are handed out in: all of an allocation's
new blocks in ascending ids (the growth run first), so evicted blocks merge with each other and
with the empty ones. `eviction_slack` s > 0 relaxes that for longer runs after churn: the m
blocks evicted are the longest runs among the ceil((1 + s) m) least recently freed ones (never
a block fresher than those; bench/block_churn.py measures what it buys).

With a host tier (`host_tier`, --kv-offloading-size) an evicted hashed block is not lost: its
eviction orders a copy into a host slot under the same hash (host_tier_index.py), and a prefix
lookup that runs out of device hits continues in the tier; the scheduler allocates device blocks
for those host hits and `restore` orders their copies back. The copies an allocation orders are
collected in `tier_ops`, in order (a block's copy out always before anything reuses it), and
leave with the step (`take_tier_ops`), whose runner carries them out beside its forward.

Off the step's critical path (TierCopy.wait): a restore's blocks are published only when its
request runs (`publish_restored`, a step later: the scheduler holds it out of the step that
copies them), so nothing in that step reads them and its forward does not wait for the copy.
A store must read its block before the step that reuses it writes there, so the store of an
evicted block is waited for; to keep those few, `take_tier_ops` also stores ahead the hashed
free blocks next in line for eviction (`store_ahead_blocks` of them, about one step's worth)
that the tier does not hold yet: overlapped with this step, waited for by the next, and when
such a block is evicted later its hash is already in the tier and nothing is copied.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from itertools import islice

from pdserve.worker.engine.free_runs import FreeRuns
from pdserve.worker.engine.host_tier_index import UNREPORTED, HostBlock, HostTierIndex, TierCopy
from pdserve.worker.request.request import Request

NONE_HASH = 0


def hash_block(parent: int, tokens: list[int] | tuple[int, ...]) -> int:
    """Stable 64-bit hash (the same in every process, so routers can compute it too)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little") + array("q", tokens).tobytes(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def lora_hash_root(lora_name: str | None) -> int:
    """The parent hash of a sequence's first block: NONE_HASH for the base model, one of the
    adapter's own otherwise, so that equal tokens under two adapters (or an adapter and the
    base) never hash alike: their KV differs from the first layer's projections on."""
    if lora_name is None:
        return NONE_HASH
    return int.from_bytes(hashlib.blake2b(b"lora:" + lora_name.encode(), digest_size=8).digest(), "little")


def hash_prefix_blocks(token_ids: list[int], block_size: int, parent: int = NONE_HASH) -> list[int]:
    hashes = []
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    # Whether requests hold blocks a window lets go of (hybrid_block_manager.py); the scheduler
    # calls release_outside_window only then.
    windowed = False

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, on_event=None,
                 eviction_slack: float = 0.0, host_tier: HostTierIndex | None = None):
        if eviction_slack < 0:
            raise ValueError(f"eviction_slack must be >= 0, got {eviction_slack}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.eviction_slack = eviction_slack
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # free and hashed, least recently freed first
        self.empty_runs = FreeRuns(num_blocks)  # free blocks that hold no hash
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found
        # on_event(kind, block_hashes, parent_hash, token_ids[, lora_name=][, medium=]): KV cache
        # events for the router; lora_name only for blocks computed under an adapter, medium "CPU"
        # for the host tier's (absent: the device's).
        self.on_event = on_event
        self.host_tier = host_tier if enable_prefix_caching else None
        self.tier_ops: list[TierCopy] = []
        self.host_queries = 0  # prompt tokens looked up in the host tier (those the device missed)
        self.host_hits = 0  # of those, tokens found there
        # With a host tier: what an event names about each hashed device block, kept for its store.
        self.block_info: list[HostBlock | None] = [None] * num_blocks if self.host_tier is not None else []
        # Hashed free blocks next in line for eviction stored in the tier ahead of it (0: only at
        # eviction); the scheduler sets about one step's blocks.
        self.store_ahead_blocks = 0

    @property
    def empty(self) -> bytearray:
        """empty[b] == 1: b is free and holds no hash (read-only view for callers)."""
        return self.empty_runs.mask

    @property
    def num_empty(self) -> int:
        return len(self.empty_runs)

    @property
    def num_free_blocks(self) -> int:
        return self.num_empty + len(self.cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def lookup_prefix(self, req: Request) -> list[int]:
        """Block ids holding the longest cached prefix of `req` (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        # Never hit the whole sequence: the last token must run to produce logits.
        max_blocks = (req.num_tokens - 1) // self.block_size
        if not req.block_hashes:
            req.block_hashes = hash_prefix_blocks(req.token_ids, self.block_size, lora_hash_root(req.lora_name))
        hits = []
        for h in req.block_hashes[:max_blocks]:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def lookup_host(self, req: Request, cached: list[int]) -> list[int]:
        """Host slots holding the blocks right after `req`'s device hits `cached` (the longest
        such run, still leaving a token to compute); their copies back are ordered by `restore`."""
        if self.host_tier is None or not req.block_hashes:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.host_tier.lookup(req.block_hashes[len(cached):max_blocks])

    def record_host_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.host_queries += num_tokens
        self.host_hits += num_hit_tokens

    def restore(self, req: Request, first: int, slots: list[int]) -> None:
        """`req` owns blocks `first`..: copy host `slots` into them (ordered with this step's
        copies, which do not wait for it) and count them as its computed prefix. They are
        published as device hits are by `publish_restored`, once the request runs in a step
        after this one (whose forward waits for the copy): none reads them before."""
        for i, slot in enumerate(slots):
            self.tier_ops.append(TierCopy(False, req.block_ids[first + i], slot, wait=False))
        self.host_tier.restored_blocks += len(slots)
        req.num_computed_tokens = (first + len(slots)) * self.block_size

    def publish_restored(self, req: Request) -> None:
        """`req`'s restored blocks are read from now on: publish them in the prefix cache."""
        self.register_computed(req)

    def take_tier_ops(self) -> list[TierCopy]:
        """The copies ordered since the last call, in order, then the stores ahead of eviction;
        the host slots they read are free for the LRU again (a later store's copy is ordered
        after them)."""
        if self.host_tier is None:
            return []
        self._store_ahead()
        self.host_tier.unlock_all()
        ops, self.tier_ops = self.tier_ops, []
        return ops

    def _store_ahead(self) -> None:
        """Store the hashed free blocks that the next allocations would evict (the first of the
        free queue, beyond the empty blocks taken before them) and that the tier lacks. They are
        free and not taken by this schedule: nothing writes them until a later step reuses them,
        and that step's forward waits for these copies. A hybrid cache stores at eviction only."""
        need = self.store_ahead_blocks - self.num_empty
        if need <= 0 or self.windowed or not self.cached_free:
            return
        held, block_hash, block_info = self.host_tier.slot_of, self.block_hash, self.block_info
        for b in islice(self.cached_free, math.ceil((1 + self.eviction_slack) * need)):
            h = block_hash[b]
            if h not in held and block_info[b] is not None:
                self._store(b, h, block_info[b], wait=False)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------------------

    def can_allocate(self, req: Request, num_tokens: int, cached: list[int] = (), sliding_from: int = 0) -> bool:
        """Whether `req` can own blocks for its first `num_tokens` tokens (taking `cached` hits).
        `sliding_from`: a hybrid cache's first sliding block to allocate (hybrid_block_manager.py)."""
        have = len(req.block_ids) + len(cached)
        new = max(0, self.blocks_needed(num_tokens) - have)
        if not new and not cached:  # a decode within its last block: every step of most requests
            return True
        reclaimed = sum(1 for b in cached if self.ref_counts[b] == 0)  # hits sitting in the free queue
        return new + reclaimed <= self.num_free_blocks

    def take_cached(self, req: Request, cached: list[int]) -> None:
        for b in cached:
            self._ref(b)
        req.block_ids.extend(cached)
        req.num_hashed_blocks = len(req.block_ids)
        req.num_computed_tokens = len(req.block_ids) * self.block_size

    def allocate(self, req: Request, num_tokens: int, sliding_from: int = 0) -> None:
        """Grow `req` to own blocks for its first `num_tokens` tokens. Caller checked can_allocate."""
        n = self.blocks_needed(num_tokens) - len(req.block_ids)
        if n > 0:
            req.block_ids.extend(self._new_blocks(req.block_ids[-1] + 1 if req.block_ids else None, n))

    def _new_blocks(self, after: int | None, n: int) -> list[int]:
        """n blocks, referenced once: the run starting at `after` first (a table growing past its
        last block stays one run), then the rest in ascending ids."""
        grow = self.empty_runs.take_from(after, n) if after is not None else range(0)
        rest = self.empty_runs.take(min(n - len(grow), self.num_empty))
        evicted = self._evict_oldest(n - len(grow) - len(rest))
        new = list(grow) + sorted(rest + evicted)
        for b in new:
            self.ref_counts[b] = 1
        return new

    def _evict_oldest(self, m: int) -> list[int]:
        """Take m cached free blocks out of the prefix cache: the m least recently freed, or with
        eviction_slack s, the longest runs among the ceil((1 + s) m) least recently freed."""
        if m <= 0:
            return []
        if not self.eviction_slack:
            out = [self.cached_free.popitem(last=False)[0] for _ in range(m)]
        else:
            window = sorted(islice(self.cached_free, math.ceil((1 + self.eviction_slack) * m)))
            runs: list[list[int]] = []
            for b in window:
                if runs and runs[-1][-1] + 1 == b:
                    runs[-1].append(b)
                else:
                    runs.append([b])
            runs.sort(key=len, reverse=True)  # stable: equal lengths keep ascending ids
            out = []
            for r in runs:
                out.extend(r[:m - len(out)])
                if len(out) == m:
                    break
            for b in out:
                del self.cached_free[b]
        for b in out:
            self._evict(b)
        return out

    def free_request(self, req: Request) -> None:
        self._release(req.block_ids)
        req.block_ids = []
        req.num_hashed_blocks = 0
        req.num_computed_tokens = 0

    def register_computed(self, req: Request, num_tokens: int | None = None) -> None:
        """Publish `req`'s newly completed full blocks in the prefix cache (those within its
        first `num_tokens` tokens: async scheduling's step in flight has not made the rest known)."""
        if not self.enable_prefix_caching:
            return
        computed = req.num_computed_tokens if num_tokens is None else min(num_tokens, req.num_computed_tokens)
        full = min(computed // self.block_size, len(req.block_ids))
        if full <= req.num_hashed_blocks:
            return
        if len(req.block_hashes) < full:
            parent = req.block_hashes[-1] if req.block_hashes else lora_hash_root(req.lora_name)
            start = len(req.block_hashes)
            req.block_hashes += hash_prefix_blocks(
                req.token_ids[start * self.block_size:full * self.block_size], self.block_size, parent)
        stored = []
        for i in range(req.num_hashed_blocks, full):
            h, b = req.block_hashes[i], req.block_ids[i]
            if h not in self.hash_to_block and self.block_hash[b] is None:
                self.hash_to_block[h] = b
                self.block_hash[b] = h
                stored.append(i)
                if self.host_tier is not None:
                    self.block_info[b] = HostBlock(
                        req.block_hashes[i - 1] if i else (lora_hash_root(req.lora_name) if req.lora_name else None),
                        tuple(req.token_ids[i * self.block_size:(i + 1) * self.block_size]), req.lora_name)
        if stored and self.on_event:
            # A prompt's first block: no parent, or the adapter's root (lora_hash_root), so that a
            # router keying blocks by (parent, tokens) never takes it for the base model's.
            parent = req.block_hashes[stored[0] - 1] if stored[0] else (
                lora_hash_root(req.lora_name) if req.lora_name else None)
            tokens = req.token_ids[stored[0] * self.block_size:(stored[-1] + 1) * self.block_size]
            lora = {"lora_name": req.lora_name} if req.lora_name else {}
            self.on_event("BlockStored", [req.block_hashes[i] for i in stored], parent, tokens, **lora)
        req.num_hashed_blocks = full

    def _ref(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            if self.block_hash[b] is not None:
                del self.cached_free[b]
            else:  # not reached by prefix hits (they are hashed); kept exact for any caller
                self.empty_runs.take_block(b)
        self.ref_counts[b] += 1

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[b] = None
            if self.host_tier is not None:
                self._offload(b, h)
            if self.on_event:
                self.on_event("BlockRemoved", [h], None, None)

    def _offload(self, b: int, h: int) -> None:
        """Device block `b` (hash `h`) is being evicted: order its copy into the host tier."""
        info, self.block_info[b] = self.block_info[b], None
        if info is None:  # published other than by register_computed: nothing to name it by
            return
        self._store(b, h, info)

    def _store(self, b: int, h: int, info: HostBlock, wait: bool = True) -> None:
        """Order block `b`'s copy into a host slot under `h`; events name it unless UNREPORTED.
        A hash the tier holds already (stored ahead) is made most recent, nothing copied."""
        slot, dropped = self.host_tier.store(h, info)
        if slot is None:
            return
        self.tier_ops.append(TierCopy(True, b, slot, wait))
        if self.on_event:
            if dropped is not None:
                self.on_event("BlockRemoved", [dropped], None, None, medium="CPU")
            if info is not UNREPORTED:
                lora = {"lora_name": info.lora_name} if info.lora_name else {}
                self.on_event("BlockStored", [h], info.parent, list(info.token_ids), medium="CPU", **lora)

    def _release(self, block_ids: list[int]) -> None:
        # Freed blocks join the back of the LRU queue (evicted after older free blocks), tail
        # blocks ahead of head blocks: a shared prefix outlives the tails built on it.
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.cached_free[b] = None
                else:
                    self.empty_runs.put(b)
