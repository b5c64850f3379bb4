"""The hybrid block manager (sliding-window layers): blocks behind the window go back to the pool,
prefix hits reuse only what is still held, the null block is never handed out."""

from __future__ import annotations

from pdserve.worker.attention.kv_groups import KVGroups
from pdserve.worker.engine.host_tier_index import HostTierIndex, TierCopy
from pdserve.worker.engine.hybrid_block_manager import HybridBlockManager
from pdserve.worker.engine.scheduler import Scheduler
from tests.worker.test_block_manager import compute, req

BS, WINDOW = 4, 8
GROUPS = KVGroups(num_layers=2, window=WINDOW, sliding_layers=(0,))


def manager(num_blocks=41, **kw) -> HybridBlockManager:
    return HybridBlockManager(num_blocks, BS, GROUPS, **kw)


def test_groups_split_the_layers_into_slots():
    g = KVGroups(num_layers=6, window=128, sliding_layers=(0, 2, 4))
    assert g.slots == 3 and [g.slot(i) for i in range(6)] == [0, 0, 1, 1, 2, 2]
    assert KVGroups(4, 8, (1,)).slots == 3
    # Keys > query - window: a query at 11 with window 8 reads 4..11, from block 1 on.
    assert GROUPS.first_needed_block(11, BS) == 1 and GROUPS.first_needed_block(7, BS) == 0


def test_blocks_behind_the_window_are_freed():
    bm = manager()
    assert bm.num_free_blocks == 40 and bm.null_block == 40
    r = req("a", range(40))
    bm.allocate(r, 40)
    assert len(r.block_ids) == len(r.sliding_block_ids) == 10 and bm.num_free_blocks == 20
    r.num_computed_tokens = 40
    # The next query (position 40) reads 33..40: blocks 8 and 9 of the sliding table.
    assert bm.release_outside_window(r) == 8
    assert bm.num_free_blocks == 28
    assert r.sliding_block_ids[:8] == [bm.null_block] * 8 and bm.null_block not in r.sliding_block_ids[8:]
    assert bm.release_outside_window(r) == 0  # idempotent
    bm.free_request(r)
    assert bm.num_free_blocks == 40


def test_the_null_block_is_never_handed_out():
    bm = manager(num_blocks=9)
    rs = [req(str(i), range(8)) for i in range(2)]
    for r in rs:
        assert bm.can_allocate(r, 8)
        bm.allocate(r, 8)
    assert bm.num_free_blocks == 0 and not bm.can_allocate(req("c", range(4)), 4)
    assert sorted(b for r in rs for b in r.block_ids + r.sliding_block_ids) == list(range(8))


def prefill(bm: HybridBlockManager, r, n_tokens: int) -> None:
    bm.allocate(r, n_tokens)
    r.num_computed_tokens = n_tokens
    bm.register_computed(r)
    bm.release_outside_window(r)


def test_prefix_hit_after_release_takes_the_released_blocks_still_cached():
    bm = manager()
    a = req("a", range(40))
    prefill(bm, a, 40)
    a_tail = a.sliding_block_ids[8:]
    bm.free_request(a)
    b = req("b", list(range(40)) + [99])
    hit = bm.lookup_prefix(b)
    # All 10 full blocks hit; the sliding table: null before the window of position 40, then blocks 8, 9.
    assert len(hit) == 10 and hit.sliding[:8] == [bm.null_block] * 8
    assert hit.sliding[8:] == [bm.hash_to_block[k] for k in sliding_keys(b, (8, 9))] == a_tail
    assert bm.can_allocate(b, 41, hit)
    bm.take_cached(b, hit)
    bm.allocate(b, 41)
    assert b.num_computed_tokens == 40 and len(b.sliding_block_ids) == 11 and b.num_released_sliding == 8
    assert bm.num_free_blocks == 40 - 11 - 3



def cache_40_tokens_then_evict_the_last_sliding_block(bm):
    """Request "a" prefills 40 tokens and finishes; the sliding block of its tokens 36..39 is then
    evicted. Returns its sliding blocks still in the window (tail[1] is the evicted one)."""
    a = req("a", range(40))
    prefill(bm, a, 40)
    tail = a.sliding_block_ids[8:]
    bm.free_request(a)
    bm._ref(tail[1])
    bm._evict(tail[1])
    return tail

def test_a_hit_whose_window_was_evicted_is_shortened():
    events = []
    bm = manager(on_event=lambda kind, hashes, *_: events.append(kind))
    # Evict the sliding block of tokens 36..39 (the last block): a hit of 10 blocks needs it.
    tail = cache_40_tokens_then_evict_the_last_sliding_block(bm)
    assert events == ["BlockStored"]  # a sliding block's eviction is not a routable event
    b = req("b", list(range(40)) + [99])
    hit = bm.lookup_prefix(b)
    # A hit of 9 blocks (36 tokens) needs sliding blocks (36 - 7) // 4 = 7 and 8, both still
    # cached (block 7 was hashed before it fell behind the window and was released).
    assert len(hit) == 9
    assert hit.sliding == [bm.null_block] * 7 + [bm.hash_to_block[k] for k in sliding_keys(b, (7, 8))]
    assert tail[0] == hit.sliding[8]


def sliding_keys(r, idx):
    from pdserve.worker.engine.hybrid_block_manager import SLIDING_SALT

    return [r.block_hashes[i] ^ SLIDING_SALT for i in idx]


def test_scheduler_releases_while_decoding_and_frees_everything_at_the_end():
    bm = manager(num_blocks=21)  # 20 usable: one 40-token prompt takes them all
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    r = req("a", range(39), max_tokens=6)
    sched.add(r)
    compute(sched, sched.schedule())
    assert bm.num_free_blocks == 0
    free_after = []
    while sched.has_work():
        batch = sched.schedule()
        free_after.append(bm.num_free_blocks)
        compute(sched, batch)
    # The first decode's schedule released sliding blocks 0..7 (the query at 39 reads 32..39);
    # the next one grew both tables by a block (position 40) and released nothing more.
    assert free_after[:2] == [8, 6]
    assert bm.num_free_blocks == 20


def test_a_host_tier_gives_back_the_window_the_device_lost():
    # The full blocks still on the device, the sliding block the window needs in the tier: a hit
    # of all 10 blocks, that block restored into a fresh one and published; nothing else copied.
    events = []
    bm = manager(on_event=lambda kind, hashes, *_, **kw: events.append((kind, kw.get("medium"))),
                 host_tier=HostTierIndex(8))
    tail = cache_40_tokens_then_evict_the_last_sliding_block(bm)
    stored = bm.take_tier_ops()
    assert stored == [TierCopy(True, tail[1], 0)] and events == [("BlockStored", None)]  # silent
    b = req("b", list(range(40)) + [99])
    hit = bm.lookup_prefix(b)
    assert len(hit) == 10 and hit.sliding == [bm.null_block] * 8 + [tail[0], None]
    assert bm.lookup_host(b, hit) == [] and hit.host.sliding == {9: 0}
    assert bm.can_allocate(b, 41, hit)
    free = bm.num_free_blocks
    bm.take_cached(b, hit)
    bm.allocate(b, 41)
    restored = b.sliding_block_ids[9]
    assert bm.take_tier_ops() == [TierCopy(False, restored, 0)]
    assert bm.hash_to_block[sliding_keys(b, (9,))[0]] == restored  # a device hit again for the next one
    assert b.num_computed_tokens == 40 and b.num_released_sliding == 8
    assert free - bm.num_free_blocks == 11 + 1 + 2  # the hits taken back, the restored block, position 40


def test_a_host_tier_hit_takes_full_blocks_and_only_the_window():
    # Everything of a evicted to the tier: b's hit is 10 full blocks and sliding blocks 8, 9.
    bm = manager(num_blocks=41, host_tier=HostTierIndex(64))
    a = req("a", range(40))
    prefill(bm, a, 40)
    bm.free_request(a)
    for blk in list(bm.cached_free):
        bm._ref(blk)
        bm._evict(blk)
    bm.take_tier_ops()
    b = req("b", list(range(40)) + [99])
    hit = bm.lookup_prefix(b)
    host = bm.lookup_host(b, hit)
    assert len(hit) == 0 and len(host) == 10 and sorted(host.sliding) == [8, 9]
    assert hit.sliding == [bm.null_block] * 8 + [None, None]
    bm.take_cached(b, hit)
    bm.allocate(b, 41)
    bm.restore(b, 0, host)
    ops = bm.take_tier_ops()
    assert [op.block for op in ops] == b.sliding_block_ids[8:10] + b.block_ids[:10]
    assert not any(op.out for op in ops) and b.num_computed_tokens == 40
    # The full blocks' copies overlap the step (b is held out of it); the window's, published at
    # once, are waited for.
    assert [op.wait for op in ops] == [True] * 2 + [False] * 10
    # Published once b runs (the scheduler's publish_restored), not before: nothing reads a block
    # whose copy may still be running. Then a third request hits both groups on the device.
    assert list(bm.lookup_prefix(req("c", list(range(40)) + [7]))) == []
    bm.take_tier_ops()
    bm.publish_restored(b)
    hit = bm.lookup_prefix(req("c", list(range(40)) + [7]))
    assert list(hit) == b.block_ids[:10] and hit.sliding[8:] == b.sliding_block_ids[8:10] and hit.host is None
