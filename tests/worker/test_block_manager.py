"""Block manager and scheduler: allocation, prefix reuse, eviction, preemption, abort."""

from __future__ import annotations

import math

import pytest

from pdserve.worker.engine.block_manager import BlockManager, hash_prefix_blocks
from pdserve.worker.engine.scheduler import Scheduler
from pdserve.worker.request.request import Request, RequestStatus
from pdserve.worker.request.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def compute(sched: Scheduler, batch, sample=7):
    """Pretend the model ran: every sequence that reached its end samples token `sample`."""
    sampled = {r.request_id: sample for r, n in batch.items if r.num_computed_tokens + n == r.num_tokens}
    return sched.update(batch, sampled)


def test_hashes_chain_over_prefix():
    a = hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_prefix_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same block, different parents
    assert hash_prefix_blocks([1, 2, 3, 4, 5], BS) == a[:1]  # partial blocks are never hashed


def test_allocate_and_free_restore_every_block():
    bm = BlockManager(8, BS)
    r = req("a", range(10))
    assert bm.can_allocate(r, 10)
    bm.allocate(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    bm.free_request(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []


def test_prefix_reuse_and_lru_eviction():
    bm = BlockManager(4, BS)
    first = req("a", range(9))
    bm.allocate(first, 9)
    first.num_computed_tokens = 9
    bm.register_computed(first)  # two full blocks published
    bm.free_request(first)
    second = req("b", list(range(8)) + [99])
    hits = bm.lookup_prefix(second)
    assert hits == first.block_ids[:0] + hits and len(hits) == 2
    bm.take_cached(second, hits)
    assert second.num_computed_tokens == 8
    # Allocating everything else evicts only the blocks nobody references.
    other = req("c", range(100, 108))
    assert bm.can_allocate(other, 8)
    bm.allocate(other, 8)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(req("d", range(4)), 4)


def test_lookup_always_leaves_a_token_to_compute():
    bm = BlockManager(4, BS)
    r = req("a", range(8))
    bm.allocate(r, 8)
    r.num_computed_tokens = 8
    bm.register_computed(r)
    bm.free_request(r)
    assert len(bm.lookup_prefix(req("b", range(8)))) == 1  # not 2: the last token must run


def test_scheduler_token_budget_chunks_prefill_and_decodes_first():
    bm = BlockManager(32, BS)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6, max_model_len=64)
    s.add(req("long", range(10)))
    b1 = s.schedule()
    assert [(r.request_id, n) for r, n in b1.items] == [("long", 6)]
    compute(s, b1)
    s.add(req("short", range(20, 23)))
    b2 = s.schedule()
    assert [(r.request_id, n) for r, n in b2.items] == [("long", 4)] or b2.num_tokens <= 6
    compute(s, b2)
    b3 = s.schedule()
    # "long" now decodes (1 token) and goes first; "short" gets the rest of the budget.
    assert b3.items[0][0].request_id == "long" and b3.items[0][1] == 1
    assert b3.num_tokens <= 6


def test_preemption_frees_and_requeues_then_abort_restores_blocks():
    bm = BlockManager(4, BS)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a, b = req("a", range(8), max_tokens=8), req("b", range(10, 18), max_tokens=8)
    s.add(a)
    s.add(b)
    compute(s, s.schedule())  # both prefilled: 2 blocks each, cache full
    assert bm.num_free_blocks == 0
    batch = s.schedule()  # each needs a 3rd block for its 9th token: the later one is preempted
    assert s.num_preemptions == 1 and b.status is RequestStatus.WAITING and b.block_ids == []
    assert [r.request_id for r, _ in batch.items] == ["a"]
    compute(s, batch)
    for r in (a, b):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 4 and not s.has_work()


@pytest.mark.parametrize("kw,param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(logprobs=21), "logprobs"), (dict(stop=("",)), "stop"),
])
def test_sampling_params_name_the_bad_field(kw, param):
    from pdserve.worker.request.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


# -- contiguous allocation (issue 17: few, long runs -> few transfer descriptors) ---------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from pdserve.worker.kv.block_runs import merge_runs  # noqa: E402


def runs(ids):
    return len(merge_runs(ids, ids))


def test_fresh_cache_hands_out_one_run_and_growth_extends_it():
    bm = BlockManager(64, BS)
    a = req("a", range(4 * 10))
    bm.allocate(a, 40)
    assert a.block_ids == list(range(10))
    b = req("b", range(4))
    bm.allocate(b, 4)  # b takes block 10; a's next block is not adjacent any more
    for n in range(41, 41 + 4 * 5):  # a decodes 20 tokens: 5 more blocks, one run after b's
        bm.allocate(a, n)
    assert a.block_ids == list(range(10)) + list(range(11, 16)) and runs(a.block_ids) == 2


def test_freed_middle_run_is_reused_whole_before_scattered_holes():
    bm = BlockManager(32, BS)
    reqs = [req(str(i), range(i * 100, i * 100 + 16)) for i in range(8)]  # 4 blocks each
    for r in reqs:
        bm.allocate(r, 16)
    for r in reqs[0:8:2]:
        bm.free_request(r)  # holes of 4 at 0, 8, 16, 24 (prefix caching has published nothing)
    bm.free_request(reqs[3])  # 8..11 and 12..15 join: one hole of 8
    big = req("big", range(1000, 1000 + 4 * 8))
    bm.allocate(big, 32)
    assert big.block_ids == list(range(8, 16))  # the one run long enough, not 0..3 + 8..11


def test_cached_blocks_evicted_least_recently_freed_first_after_empty_ones():
    bm = BlockManager(8, BS)
    old, new = req("old", range(8)), req("new", range(50, 58))
    for r in (old, new):  # 2 full blocks each, published in the prefix cache
        bm.allocate(r, 8)
        r.num_computed_tokens = 8
        bm.register_computed(r)
    bm.free_request(old)
    bm.free_request(new)
    filler = req("f", range(200, 216))
    bm.allocate(filler, 16)  # the 4 empty blocks go first: no prefix is lost
    assert sorted(filler.block_ids) == [4, 5, 6, 7] and len(bm.lookup_prefix(req("x", range(9)))) == 2
    two = req("two", range(300, 308))
    bm.allocate(two, 8)  # now eviction: old's blocks (freed first), handed out in ascending order
    assert two.block_ids == [0, 1] and bm.lookup_prefix(req("x", range(9))) == []
    assert len(bm.lookup_prefix(req("y", list(range(50, 58)) + [1]))) == 2


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 7), st.integers(1, 40)),
                max_size=60),
       st.booleans())
def test_allocation_never_hands_out_a_used_block_and_keeps_lru_and_runs(ops, caching):
    """Random alloc/grow/free with prefix caching: every allocation takes only free blocks; the
    cached blocks it evicts are the least recently freed ones; and where the empty free blocks
    form one run long enough, the new blocks are one run."""
    num_blocks = 48
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    live: dict[int, object] = {}
    for i, (op, slot, size) in enumerate(ops):
        r = live.get(slot)
        if op == "free" and r is not None:
            bm.free_request(live.pop(slot))
            continue
        if op == "grow" and r is not None:
            num_tokens = r.num_tokens + size
            r.token_ids += [7] * size
        elif r is None:
            r = req(f"{i}", [t % 5 for t in range(size)])  # few distinct prefixes: real hits
            hits = bm.lookup_prefix(r)
            if not bm.can_allocate(r, size, hits):
                continue
            bm.take_cached(r, hits)
            num_tokens = size
        else:
            continue
        if not bm.can_allocate(r, num_tokens):
            continue
        used = {b for x in live.values() for b in x.block_ids} | set(r.block_ids)
        empty = [b for b in range(num_blocks) if bm.empty[b]]
        need = bm.blocks_needed(num_tokens) - len(r.block_ids)
        oldest = list(bm.cached_free)[:max(0, need - len(empty))]
        before = len(r.block_ids)
        bm.allocate(r, num_tokens)
        got = r.block_ids[before:]
        assert len(got) == need and not used & set(got) and len(set(got)) == need
        assert set(got) - set(empty) == set(oldest)  # LRU eviction, only once the empty pool ran out
        if need and runs(empty) == 1 and len(empty) >= need and before == 0:
            assert runs(got) == 1
        r.num_computed_tokens = num_tokens
        bm.register_computed(r)
        live[slot] = r
        held = [b for x in live.values() for b in x.block_ids]
        assert bm.num_free_blocks + len(set(held)) == num_blocks
        assert all(bm.ref_counts[b] > 0 and not bm.empty[b] and b not in bm.cached_free for b in held)


# -- free runs: the empty pool as maximal runs (issue 24: long runs without a scan) -------------

from pdserve.worker.engine.free_runs import FreeRuns  # noqa: E402


def fewest_runs(lengths: list[int], n: int) -> int:
    """The fewest runs out of runs of these lengths that hold n blocks."""
    total = 0
    for i, length in enumerate(sorted(lengths, reverse=True)):
        total += length
        if total >= n:
            return i + 1
    raise AssertionError("not enough free blocks")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "put", "take_block", "take_from"]), st.integers(0, 63),
                          st.integers(1, 20)), max_size=80))
def test_free_runs_stay_maximal_and_take_the_fewest_runs(ops):
    fr, free = FreeRuns(64), set(range(64))
    for op, b, n in ops:
        if op == "take" and n <= len(free):
            want = fewest_runs([length for _, length in fr.runs()], n)
            got = fr.take(n)
            assert len(got) == len(set(got)) == n and set(got) <= free and runs(sorted(got)) == want
            free -= set(got)
        elif op == "put" and b not in free:
            fr.put(b)
            free.add(b)
        elif op == "take_block" and b in free:
            fr.take_block(b)
            free.discard(b)
        elif op == "take_from":
            got = fr.take_from(b, n)
            expect = []
            if b in free and b - 1 not in free:  # b starts a run
                while len(expect) < n and b + len(expect) in free:
                    expect.append(b + len(expect))
            assert list(got) == expect
            free -= set(got)
        assert len(fr) == len(free) and {i for i in range(64) if fr.mask[i]} == free
        spans = fr.runs()  # maximal, disjoint, covering exactly the free ids
        assert sum(length for _, length in spans) == len(free) == len({*free})
        assert len(spans) == runs(sorted(free)) if free else spans == []


def churn(bm: BlockManager, seed: int, turns: int = 300) -> list:
    """Random arrivals of mixed lengths (unique prompts: full blocks enter the prefix cache when
    freed), decode growth and finishes; returns the live requests."""
    import random

    rng, live, nxt = random.Random(seed), [], 0
    for i in range(turns):
        if live and rng.random() < 0.45:
            bm.free_request(live.pop(rng.randrange(len(live))))
            continue
        size = rng.randint(1, 12) * BS - rng.randrange(BS)
        r = req(f"c{i}", range(nxt, nxt + size))
        nxt += size
        if bm.can_allocate(r, size):
            bm.allocate(r, size)
            r.num_computed_tokens = size
            bm.register_computed(r)
            live.append(r)
    return live


@pytest.mark.parametrize("seed", range(4))
def test_after_churn_a_request_taking_every_free_block_gets_one_run_per_free_extent(seed):
    """Whatever churn left, the blocks handed out are ascending apart from the growth run: a
    request that takes every free block (empty and cached) gets exactly the cache's free extents
    as its runs, the fewest any allocator could give it."""
    bm = BlockManager(256, BS)
    churn(bm, seed)
    free = sorted(b for b in range(256) if bm.ref_counts[b] == 0)
    assert runs(free) > 4 and len(bm.cached_free) > len(free) // 2  # fragmented, mostly cached
    everything = req("all", range(10**6, 10**6 + len(free) * BS))
    bm.allocate(everything, len(free) * BS)
    assert everything.block_ids == free and runs(everything.block_ids) == runs(free)


@pytest.mark.parametrize("seed", range(4))
def test_after_churn_empty_blocks_go_in_the_fewest_runs(seed):
    bm = BlockManager(512, BS, enable_prefix_caching=False)  # every free block is empty
    churn(bm, seed)
    lengths = [length for _, length in bm.empty_runs.runs()]
    n = min(len(bm.empty_runs), 40)
    r = req("r", range(10**6, 10**6 + n * BS))
    bm.allocate(r, n * BS)
    assert runs(r.block_ids) == fewest_runs(lengths, n)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([0.5, 1.0, 3.0]), st.integers(1, 60))
def test_eviction_slack_evicts_only_among_the_oldest_and_only_once_empty_blocks_ran_out(seed, slack, need):
    bm = BlockManager(256, BS, eviction_slack=slack)
    live = churn(bm, seed)
    held = {b for r in live for b in r.block_ids}
    empty = {b for b in range(256) if bm.empty[b]}
    need = min(need, bm.num_free_blocks)
    m = max(0, need - len(empty))
    window = set(list(bm.cached_free)[:math.ceil((1 + slack) * m)])
    r = req("r", range(10**6, 10**6 + need * BS))
    bm.allocate(r, need * BS)
    got = set(r.block_ids)
    assert len(got) == need and not got & held
    if m:
        assert empty <= got and got - empty <= window  # every empty block first; evicted among the oldest
    else:
        assert got <= empty
    assert all(b not in bm.cached_free and not bm.empty[b] and bm.ref_counts[b] == 1 for b in got)


def test_eviction_slack_must_not_be_negative():
    with pytest.raises(ValueError):
        BlockManager(8, BS, eviction_slack=-0.5)


def test_eviction_slack_takes_a_run_from_among_the_oldest():
    def freed_in_order(slack):
        bm = BlockManager(8, BS, eviction_slack=slack)
        rs = [req(str(i), range(i * 10, i * 10 + BS)) for i in range(8)]
        for r in rs:  # one full block each, ids 0..7, published
            bm.allocate(r, BS)
            r.num_computed_tokens = BS
            bm.register_computed(r)
        assert [r.block_ids for r in rs] == [[i] for i in range(8)]
        for i in (0, 5, 6, 2, 1, 3, 4, 7):
            bm.free_request(rs[i])
        two = req("two", range(500, 500 + 2 * BS))
        bm.allocate(two, 2 * BS)
        return two.block_ids

    assert freed_in_order(0.0) == [0, 5]  # strict LRU: the two least recently freed
    assert freed_in_order(1.0) == [5, 6]  # the one run among the 4 least recently freed
