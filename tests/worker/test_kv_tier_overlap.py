"""The host tier's copies off the step's critical path, scheduler side (no model): a request with
host hits is held out of the step that restores it and runs from the next one, its restored
blocks published only then, others admitted behind it run meanwhile; the free blocks next in line
for eviction are stored ahead (copies no forward waits for), so their eviction copies nothing.
The runner side on CPU: the waited-for copies go first, the contents come out exact."""

from __future__ import annotations

import torch

from pdserve.worker.engine.block_manager import BlockManager
from pdserve.worker.engine.host_tier_index import HostTierIndex, TierCopy
from pdserve.worker.engine.scheduler import Scheduler
from pdserve.worker.executor.host_kv_store import HostKVStore
from pdserve.worker.request.request import RequestStatus
from tests.worker.test_block_manager import compute, req

BS = 4


def run_alone(sched: Scheduler, r) -> list[list[TierCopy]]:
    """Add `r`, schedule until nothing is left; each schedule's copies."""
    sched.add(r)
    ops = []
    while sched.has_work():
        batch = sched.schedule()
        ops.append(batch.kv_tier_ops)
        compute(sched, batch)
    return ops


def test_restores_overlap_a_step_and_stores_run_ahead_of_eviction():
    bm = BlockManager(8, BS, host_tier=HostTierIndex(32))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    assert bm.store_ahead_blocks == 4  # one step's tokens in blocks
    a, b, c = (req(name, range(base, base + 13), max_tokens=1) for name, base in (("a", 0), ("b", 100), ("c", 200)))

    assert run_alone(sched, a) == [[]]  # 3 hashed blocks freed; empty ones still cover a step
    a_hashes = a.block_hashes[:3]
    b_ops = run_alone(sched, b)
    # b took empty blocks; a's, next in line for eviction, went to the tier ahead: not waited for.
    ahead = [op for ops in b_ops for op in ops]
    assert ahead and all(op.out and not op.wait for op in ahead)
    assert {bm.block_hash[op.block] for op in ahead} <= set(a_hashes)
    c_ops = [op for ops in run_alone(sched, c) for op in ops]
    # c evicted blocks of a that the tier held already: no copy of theirs, none waited for.
    evicted_a = [h for h in a_hashes if h not in bm.hash_to_block]
    assert evicted_a and all(h in bm.host_tier for h in evicted_a)
    assert not any(op.wait for op in c_ops)

    # a again, and a new request behind it: a's host hits are copied back while e runs.
    a2, e = req("a2", range(13), max_tokens=1), req("e", range(300, 305), max_tokens=1)
    sched.add(a2)
    sched.add(e)
    batch = sched.schedule()
    assert [r.request_id for r, _ in batch.items] == ["e"]  # a2 held out of this step
    restores = [op for op in batch.kv_tier_ops if not op.out]
    assert len(restores) == len(evicted_a) and not any(op.wait for op in restores)
    assert sched.held_for_restore == [a2] and sched.waiting[0] is a2
    assert all(h not in bm.hash_to_block for h in evicted_a)  # unpublished while the copies run
    assert a2.num_computed_tokens == 12  # its device and host hits
    compute(sched, batch)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch.items] == [("a2", 1)]  # only its last token left
    assert sched.held_for_restore == [] and not sched.restoring
    assert [bm.hash_to_block[h] for h in a_hashes] == a2.block_ids[:3]  # published: it runs now
    compute(sched, batch)
    assert not sched.has_work()


def test_a_request_aborted_while_held_frees_its_unpublished_blocks():
    bm = BlockManager(8, BS, host_tier=HostTierIndex(32))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    for name, base in (("a", 0), ("b", 100), ("c", 200)):
        run_alone(sched, req(name, range(base, base + 13), max_tokens=1))
    a2 = req("a2", range(13), max_tokens=1)
    sched.add(a2)
    assert not sched.schedule() and sched.held_for_restore == [a2]
    sched.finish(a2, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_work() and not sched.restoring and bm.num_free_blocks == 8


def test_host_store_on_cpu_runs_waited_copies_first_and_stays_exact():
    cache = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 2, 4)
    store = HostKVStore(cache, 4, 4 * 8 * 4 / 2**30)
    store.slots[0] = -1.0
    before = cache.clone()
    # A restore into block 1 (overlapped), a store of block 2 the step reuses (waited for), and a
    # restore into block 2 after that store, ordered after it.
    store.apply([TierCopy(False, 1, 0, wait=False), TierCopy(True, 2, 1), TierCopy(False, 2, 0, wait=False)])
    assert torch.equal(store.slots[1], before[2]) and torch.equal(cache[1], store.slots[0])
    assert torch.equal(cache[2], store.slots[0]) and not store.pending  # synchronous: nothing left
    assert torch.equal(cache[[0, 3, 4, 5]], before[[0, 3, 4, 5]])
