"""The scheduler with the KV connector's scheduler-side hooks: who holds which blocks when.

Real parts: the Scheduler, BlockManager and KVConnectorScheduler, and real KVConnectors (the
prefill one serves its side channel on loopback). The model is not run: `compute` stands in
for a step, and the worker side's report (`KVConnectorOutput`) is written by hand where a
test needs a pull to land or fail at a chosen moment. Pulls over real transports are tested
in test_kv_transfer.py and test_pd_engines.py.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from pdserve.protocol.kv_layout import KVLayout
from pdserve.protocol.kv_transfer import STREAM_UNSUPPORTED
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.engine.block_manager import BlockManager
from pdserve.worker.engine.scheduler import Scheduler
from pdserve.worker.kv.connector import KVConnector
from pdserve.worker.kv.connector_meta import KVConnectorOutput
from pdserve.worker.kv.connector_scheduler import KVConnectorScheduler
from pdserve.worker.request.request import Request, RequestStatus
from pdserve.worker.request.sampling_params import SamplingParams
from tests.net import free_port

BS, BLOCKS, VOCAB = 4, 16, 1000
LAYOUT = KVLayout(1, 1, 4, "float32", BS)


# Each scheduler's worker half: `compute` hands it the step's orders, as the engine does.
WORKER_HALF: "weakref.WeakKeyDictionary[Scheduler, KVConnector]" = weakref.WeakKeyDictionary()


def compute(sched: Scheduler, batch, sample=7):
    sampled = {r.request_id: sample for r, n in batch.items if r.num_computed_tokens + n == r.num_tokens}
    finished = sched.update(batch, sampled)
    WORKER_HALF[sched].apply(sched.connector.build_connector_meta())  # finished prefills' pins
    return finished


def make(role: str):
    cfg = EngineConfig(role=role, kv_transfer="tcp", kv_port=free_port(), kv_pin_ttl=30, kv_peer_allow=("127.0.0.1",))
    transfer = KVConnector(cfg, torch.zeros(BLOCKS, 1, 2, BS, 1, 4), f"{role}-engine", LAYOUT)
    if role == "prefill":
        transfer.start_server()
    bm = BlockManager(BLOCKS, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                      connector=KVConnectorScheduler(BS, VOCAB, 64, transfer.endpoint()))
    WORKER_HALF[sched] = transfer
    return sched, bm, transfer


@pytest.fixture
def prefill():
    sched, bm, transfer = make("prefill")
    yield sched, bm, transfer
    transfer.shutdown()


@pytest.fixture
def decode():
    sched, bm, transfer = make("decode")
    yield sched, bm, transfer
    transfer.shutdown()


def remote_params(prefill, prompt) -> dict:
    """What a prefill worker hands back (as the wire has it): run the prompt there for one token."""
    sched, _, _ = prefill
    r = Request(f"p-{len(prompt)}-{prompt[0]}", prompt, SamplingParams(max_tokens=16), (),
                {"do_remote_decode": True})
    assert sched.add(r)
    (done,) = compute(sched, sched.schedule())
    return done.kv_transfer_params_out.to_dict()


def decode_request(rid, prompt, params, max_tokens=4):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), (), params)


def test_finished_prefill_keeps_prompt_blocks_until_the_read_is_released(prefill):
    sched, bm, transfer = prefill
    r = Request("p", list(range(10)), SamplingParams(max_tokens=16), (), {"do_remote_decode": True})
    assert sched.add(r) and r.params.max_tokens == 1  # a prefill for a remote decode runs one token
    (done,) = compute(sched, sched.schedule())
    params = done.kv_transfer_params_out
    assert done.status is RequestStatus.FINISHED_LENGTH and params.first_token_id == 7
    assert list(params.remote_block_ids) == r.block_ids == [0, 1, 2] and params.kv_layout == LAYOUT
    assert sched.sending == {"p": r} and sched.num_sending_blocks == 3 and bm.num_free_blocks == BLOCKS - 3
    assert not sched.has_work()
    assert sched.update_from_kv_xfer(transfer.get_finished()) == [] and bm.num_free_blocks == BLOCKS - 3
    assert transfer.pins.release("p", params.transfer_token)
    sched.update_from_kv_xfer(transfer.get_finished())
    assert bm.num_free_blocks == BLOCKS and not sched.sending


def test_aborted_prefill_frees_at_once(prefill):
    sched, bm, _ = prefill
    r = Request("p", list(range(10)), SamplingParams(max_tokens=16), (), {"do_remote_decode": True})
    sched.add(r)
    sched.schedule()
    sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert r.kv_transfer_params_out is None and bm.num_free_blocks == BLOCKS and not sched.sending


def test_remote_decode_waits_for_its_pull_then_decodes(prefill, decode):
    prompt = list(range(100, 110))
    params = remote_params(prefill, prompt)
    sched, bm, _ = decode
    r = decode_request("d", prompt, params)
    assert sched.add(r) and r.output_token_ids == [7]  # the prefill worker's first token
    batch = sched.schedule()
    assert not batch and r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(r.block_ids) == 3 and sched.has_work()  # 11 tokens: every block the pull writes, and the next
    (load,) = batch.kv_connector_metadata.loads
    assert load.indices == [0, 1, 2] and load.dst_blocks == r.block_ids and load.params.to_dict() == params
    assert not sched.schedule()  # still waiting: nothing to run
    sched.update_from_kv_xfer(KVConnectorOutput(finished_recving=["d"]))
    assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 10
    batch = sched.schedule()
    assert [(q.request_id, n) for q, n in batch.items] == [("d", 1)]  # only the first token's KV is computed
    assert r.status is RequestStatus.RUNNING


def test_failed_pull_prefills_the_rest_locally(prefill, decode):
    prompt = list(range(200, 210))
    params = remote_params(prefill, prompt)
    sched, bm, transfer = decode
    r = decode_request("d", prompt, params)
    sched.add(r)
    sched.schedule()
    sched.update_from_kv_xfer(KVConnectorOutput(failed_recving=["d"]))
    assert transfer.metrics.local_prefill_fallbacks._value.get() == 1
    batch = sched.schedule()
    assert [(q.request_id, n) for q, n in batch.items] == [("d", 11)]  # prompt and first token, here
    # Nothing landed, so no landing stamp; admitted before its first scheduling as any request.
    assert r.status is RequestStatus.RUNNING and r.kv_landed_time is None
    assert r.admitted_time <= r.first_scheduled_time
    compute(sched, batch)
    assert r.output_token_ids == [7, 7]


def test_abort_mid_pull_frees_blocks_only_when_the_pull_reports(prefill, decode):
    params = remote_params(prefill, list(range(300, 310)))
    sched, bm, _ = decode
    r = decode_request("d", list(range(300, 310)), params)
    sched.add(r)
    sched.schedule()
    sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == BLOCKS - 3  # the pull may still be writing them
    sched.update_from_kv_xfer(KVConnectorOutput(finished_recving=["d"]))
    assert bm.num_free_blocks == BLOCKS and not sched.has_work()


def test_unpulled_remote_kv_is_released(prefill, decode):
    params = remote_params(prefill, list(range(400, 410)))
    sched, bm, _ = decode
    # Ended by its handed-over token: finished on arrival, and the prefill worker's pin released.
    done = decode_request("a", list(range(400, 410)), params, max_tokens=1)
    assert not sched.add(done) and done.status is RequestStatus.FINISHED_LENGTH
    # Aborted while queued (a full batch ahead of it): released too, never pulled.
    queued = decode_request("b", list(range(400, 410)), params)
    sched.add(queued)
    sched.finish(queued, RequestStatus.FINISHED_ABORTED)
    meta = sched.schedule().kv_connector_metadata
    assert [p.to_dict() for p in meta.releases] == [params, params] and not meta.loads and bm.num_free_blocks == BLOCKS


def test_prompt_blocks_in_the_local_prefix_cache_are_not_pulled(prefill, decode):
    prompt = list(range(500, 512))  # three full blocks
    params = remote_params(prefill, prompt)
    sched, bm, _ = decode
    local = decode_request("local", prompt + [1], None, max_tokens=1)
    sched.add(local)
    compute(sched, sched.schedule())  # caches the prompt's three blocks here
    r = decode_request("d", prompt, params)
    sched.add(r)
    batch = sched.schedule()
    # Nothing left to pull: it runs at once, and the prefill worker is told to drop its pin.
    assert [(q.request_id, n) for q, n in batch.items] == [("d", 1)]
    meta = batch.kv_connector_metadata
    assert [p.to_dict() for p in meta.releases] == [params] and not meta.loads


def test_pins_are_capped_at_half_the_cache(prefill):
    """A flood of prefill-only requests cannot pin the whole cache: past half of it the next
    prefill for a remote decode waits in the queue (holding nothing) until a pin is released."""
    sched, bm, transfer = prefill
    reqs = [Request(f"p{i}", list(range(10 * i, 10 * i + 10)), SamplingParams(max_tokens=16), (),
                    {"do_remote_decode": True}) for i in range(3)]  # 3 blocks each; 16 blocks, cap 8
    outs = []
    for r in reqs[:2]:
        sched.add(r)
        (done,) = compute(sched, sched.schedule())
        outs.append(done.kv_transfer_params_out)
    sched.add(reqs[2])
    assert not sched.schedule() and reqs[2].status is RequestStatus.WAITING and not reqs[2].block_ids
    assert transfer.pins.release("p0", outs[0].transfer_token)
    sched.update_from_kv_xfer(transfer.get_finished())
    (done,) = compute(sched, sched.schedule())  # admitted now that 3 pinned + 3 <= 8
    assert done is reqs[2] and done.kv_transfer_params_out
    for p in (outs[1], done.kv_transfer_params_out):
        assert transfer.pins.release(p.remote_request_id, p.transfer_token)
    sched.update_from_kv_xfer(transfer.get_finished())
    assert bm.num_free_blocks == BLOCKS and not sched.sending


def test_latency_stamps_of_a_remote_decode(prefill, decode):
    """Admission (blocks allocated for the pull), landing, first scheduling: each stamped once, in
    that order; vLLM's queue time ends at the first scheduling, after the pull."""
    prompt = list(range(300, 310))
    params = remote_params(prefill, prompt)
    sched, _, _ = decode
    r = decode_request("d", prompt, params)
    sched.add(r)
    assert r.admitted_time is None and r.first_scheduled_time is None
    sched.schedule()
    admitted = r.admitted_time
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS and r.arrival_time <= admitted
    assert r.first_scheduled_time is None and r.kv_landed_time is None
    sched.update_from_kv_xfer(KVConnectorOutput(finished_recving=["d"]))
    assert admitted <= r.kv_landed_time and r.first_scheduled_time is None
    sched.schedule()
    assert r.status is RequestStatus.RUNNING and r.kv_landed_time <= r.first_scheduled_time
    first = r.first_scheduled_time
    sched._preempt(r)
    sched.schedule()  # readmitted: its first admission and scheduling stay as they were
    assert r.status is RequestStatus.RUNNING and (r.admitted_time, r.first_scheduled_time) == (admitted, first)


def test_a_foreign_kv_layout_is_refused_and_prefilled_locally(prefill, decode):
    # A prefill worker of another KV dtype (or fp8 scales, or block size): its bytes would decode
    # as garbage here. Not the client's fault: no error, no pull; the prompt is prefilled here
    # (same answer), the prefill worker's pin released at once, the fallback counted.
    from pdserve.worker.request.request import RequestError

    prompt = list(range(600, 610))
    params = {**remote_params(prefill, prompt), "kv_layout": f"1x1x4:float8_e4m3fn@1:{BS}"}
    sched, bm, transfer = decode
    sched.connector.check_params(parse(params), prompt)  # accepted: a fallback, not a 400
    r = decode_request("d", prompt, params)
    assert sched.add(r) and r.output_token_ids == [7]
    batch = sched.schedule()
    assert [(q.request_id, n) for q, n in batch.items] == [("d", 11)]  # prompt and first token, here
    meta = batch.kv_connector_metadata
    assert not meta.loads and [p.to_dict() for p in meta.releases] == [params]
    assert transfer.metrics.local_prefill_fallbacks._value.get() == 1
    # A streamed hand-off (first token still to come) cannot be served so: the router is told
    # in the code it knows (STREAM_UNSUPPORTED) and hands over the final params instead.
    streamed = {**params, "stream_kv": True, "first_token_id": None}
    with pytest.raises(RequestError, match="describe KV layout '1x1x4:float8_e4m3fn@1:4' but this worker's is "
                                           "'1x1x4:float32:4'") as e:
        sched.connector.check_params(parse(streamed), prompt)
    assert e.value.code == STREAM_UNSUPPORTED


def parse(params: dict):
    from pdserve.protocol.kv_transfer import parse_kv_transfer_params

    return parse_kv_transfer_params(params)


def test_async_streamed_progress_is_each_steps_own(prefill):
    """Async scheduling: chunk k+1 is launched (`advance`) before chunk k is collected (`update`
    with the counts `advance` returned for it). The pin advances to chunk k's blocks only, never
    to the chunk still in flight, and the finished prefill pins every block with its first token."""
    sched, bm, transfer = prefill
    sched.connector.stream_chunk_tokens, sched.connector.stream_split = 8, "even"
    r = Request("s", list(range(20)), SamplingParams(max_tokens=16), (), {"do_remote_decode": True, "stream_kv": True})
    assert sched.add(r)
    steps, readable = [], []
    while True:
        batch = sched.schedule()
        transfer.apply(batch.kv_connector_metadata)  # the streamed pin, at admission
        if batch:
            steps.append((batch, sched.advance(batch, {x.request_id for x, n in batch.items
                                                       if x.num_computed_tokens + n == x.num_tokens})))
        if len(steps) >= 2 or (steps and not batch):
            done, advanced = steps.pop(0)
            sampled = {x.request_id: 7 for (x, _), c in zip(done.items, advanced) if c == x.num_tokens}
            finished = sched.update(done, sampled, advanced=advanced)
            meta = sched.connector.build_connector_meta()
            readable += [ready for rid, ready in meta.advances if rid == "s"]
            assert all(ready * BS <= advanced[0] for ready in readable[-1:])  # chunk k only
            transfer.apply(meta)
            if finished:
                assert meta.finishes == [("s", 7)]
                break
        assert len(readable) < 10
    assert readable == [2, 4]  # 8 and 16 of 20 tokens: never the chunk in flight
    assert transfer.pins.state("s") == {"ready": 5, "state": "done", "first_token_id": 7, "last": True}
