"""`--scheduling-policy priority` (vLLM's): the waiting queue in (priority, arrival) order, and
the least urgent running request the one preempted. FCFS beside it, unchanged."""

from __future__ import annotations

import pytest

from pdserve.worker.engine.block_manager import BlockManager
from pdserve.worker.engine.scheduler import Scheduler
from pdserve.worker.request.request import Request, RequestStatus
from pdserve.worker.request.sampling_params import SamplingParams

BS = 4


def req(rid: str, start: int, priority: int = 0, n: int = 8, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(start, start + n)),
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority))


def compute(sched: Scheduler, batch, sample=7):
    sampled = {r.request_id: sample for r, n in batch.items if r.num_computed_tokens + n == r.num_tokens}
    return sched.update(batch, sampled)


@pytest.mark.parametrize("policy,admitted", [("fcfs", ["low", "mid"]), ("priority", ["high", "mid"])])
def test_the_waiting_queue_is_ordered_by_priority(policy, admitted):
    s = Scheduler(BlockManager(32, BS), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, policy=policy)
    for r in (req("low", 0, priority=5), req("mid", 100, priority=0), req("high", 200, priority=-3)):
        s.add(r)
    batch = s.schedule()
    assert [r.request_id for r, _ in batch.items] == admitted


def test_equal_priorities_keep_arrival_order():
    s = Scheduler(BlockManager(32, BS), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, policy="priority")
    for rid, start in (("first", 0), ("second", 100), ("third", 200)):
        s.add(req(rid, start, priority=1))
    assert [r.request_id for r in s.waiting] == ["first", "second", "third"]


@pytest.mark.parametrize("policy,victim", [("fcfs", "urgent"), ("priority", "lax")])
def test_the_least_urgent_running_request_is_preempted(policy, victim):
    # Two requests fill the cache; each needs a third block for its 9th token: one must go.
    bm = BlockManager(4, BS)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, policy=policy)
    lax, urgent = req("lax", 0, priority=2), req("urgent", 100, priority=-1)
    s.add(lax)
    s.add(urgent)  # admitted last: FCFS preempts it
    compute(s, s.schedule())
    batch = s.schedule()
    out = {"lax": lax, "urgent": urgent}[victim]
    assert s.num_preemptions == 1 and out.status is RequestStatus.WAITING and out.block_ids == []
    assert [r.request_id for r, _ in batch.items] == [{"lax": "urgent", "urgent": "lax"}[victim]]
    compute(s, batch)
    for r in (lax, urgent):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 4 and not s.has_work()


def test_a_preempted_request_goes_back_to_its_place_by_priority():
    bm = BlockManager(4, BS)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, policy="priority")
    a, b = req("a", 0, priority=1), req("b", 100, priority=1)
    s.add(a)
    s.add(b)
    compute(s, s.schedule())
    s.add(req("urgent", 200, priority=0))  # waits: no block is free
    s.schedule()  # b (same priority as a, later) is preempted
    assert [r.request_id for r in s.waiting] == ["urgent", "b"]


def test_the_request_priority_reaches_the_engine():
    from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
    from pdserve.worker.server.sampling import sampling_params

    completion = CompletionRequest(model="m", prompt="hi", priority=-2)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert sampling_params(completion, 4, None, "logprobs").priority == -2
    assert sampling_params(chat, 4, None, "top_logprobs").priority == 0  # vLLM's default


@pytest.mark.parametrize("policy,first", [("fcfs", "lax"), ("priority", "urgent")])
def test_an_engine_with_one_seat_serves_the_urgent_request_first(tiny_checkpoint, policy, first):
    from tests.helpers.engines import make_engine

    engine = make_engine(tiny_checkpoint("llama"), max_num_seqs=1, scheduling_policy=policy)
    for rid, priority in (("lax", 3), ("urgent", -1)):
        engine.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                             priority=priority))
    finished: list[str] = []
    for _ in range(100):
        finished += [o.request_id for o in engine.step() if o.finished]
        if len(finished) == 2:
            break
    assert finished[0] == first and len(finished) == 2
