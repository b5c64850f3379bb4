"""Block manager and scheduler: allocation, prefix reuse, eviction, preemption, abort."""

from __future__ import annotations

import pytest

from pdserve.worker.block_manager import BlockManager, hash_prefix_blocks
from pdserve.worker.request import Request, RequestStatus
from pdserve.worker.sampling_params import SamplingParams
from pdserve.worker.scheduler import Scheduler

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
    from pdserve.worker.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == param
