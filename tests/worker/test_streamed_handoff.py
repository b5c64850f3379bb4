"""The streamed hand-off between two real engines (one process, real side channel on loopback,
real TCP or NIXL): the decode side reads each chunk while the prefill computes the next.

The prefill engine is stepped by the test, one chunk at a time, and then *held*: the decode
side must have chunk k's blocks (byte-equal to the prefill's) before chunk k+1 is computed. A
decode side that read only after the prefill ended would never get them while the prefill is
held, and the bounded wait fails. Nothing here depends on timing: every wait is for a condition.

Every test runs with both engines synchronous and with both under --async-scheduling. There a
step launches chunk k+1 before it collects chunk k, and chunk k's blocks become readable at that
collection: the timeline test checks that order of events (launch, collect, pin advance), and
that no block is ever readable before the step that wrote it was collected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import wait

import pytest
import torch

from pdserve.protocol.kv_transfer import KVTransferParams, is_streamed
from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.kv.nixl_transport import nixl_available
from pdserve.worker.request.sampling_params import SamplingParams
from tests.checkpoints import write_checkpoint, write_word_tokenizer
from tests.helpers.engines import make_engine
from tests.net import free_port

BLOCK, CHUNK = 4, 8  # two blocks per chunk
PROMPT = list(range(100, 100 + 37))  # 10 blocks, the last one partial; 5 chunks
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="needs nixl"))]
# (transport, async scheduling, where TCP's senders and receivers run: --kv-tcp-io)
PAIRS = [pytest.param(("tcp", False, "thread"), id="tcp-sync"), pytest.param(("tcp", True, "thread"), id="tcp-async"),
         pytest.param(("tcp", True, "process"), id="tcp-async-io-process"),
         pytest.param(("nixl", False, "thread"), id="nixl-sync", marks=TRANSPORTS[1].marks),
         pytest.param(("nixl", True, "thread"), id="nixl-async", marks=TRANSPORTS[1].marks)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("streamed")
    return write_checkpoint(d / "m", "llama", write_word_tokenizer(d / "tok"), hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2)


def engine(ckpt, role: str, transport: str, split: str = "even", kv_pull_timeout: float = 10, chunk: int = CHUNK,
           **kw) -> LLMEngine:
    return make_engine(ckpt, role=role, kv_transfer=transport, kv_port=free_port(), block_size=BLOCK,
                       kv_cache_memory=8 << 20, max_model_len=256, kv_stream_chunk_tokens=chunk, kv_stream_split=split,
                       kv_peer_allow=("127.0.0.1",), kv_secret="streamed-handoff-test-secret",
                       kv_pull_timeout=kv_pull_timeout, **kw)


@pytest.fixture(scope="module", params=PAIRS)
def pair(request, ckpt):
    transport, asyn, senders = request.param
    p = engine(ckpt, "prefill", transport, async_scheduling=asyn, kv_tcp_io=senders)
    d = engine(ckpt, "decode", transport, async_scheduling=asyn, kv_tcp_io=senders)
    assert p.async_scheduling == d.async_scheduling == asyn
    if senders == "process":  # the senders and the receivers really are children
        assert p.kv_connector.base.server.data.pid != os.getpid()
        assert d.kv_connector.tcp_receiver.pid != os.getpid()
    yield p, d
    p.shutdown()
    d.shutdown()


def until(cond, what: str, engines=(), timeout: float = 30.0):
    """Step `engines` (their pulls land, pins free) until `cond()`; bounded."""
    deadline = time.monotonic() + timeout
    outs = []
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for e in engines:
            outs += e.step()
        if not engines:
            time.sleep(0.001)  # another thread (a pull, a side channel) makes the change
    return outs


def announce(p: LLMEngine, rid: str, prompt=PROMPT, params=GREEDY) -> KVTransferParams:
    """Admit a streamed prefill: its params come out before any chunk is computed."""
    p.add_request(rid, prompt, params, {"do_remote_decode": True, "stream_kv": True})
    outs = []
    while not any(o.request_id == rid and o.kv_transfer_params for o in outs):
        outs += p.step()
    early = next(o for o in outs if o.request_id == rid and o.kv_transfer_params)
    assert not early.finished and not early.new_token_ids and is_streamed(early.kv_transfer_params)
    assert early.kv_transfer_params.first_token_id is None
    return early.kv_transfer_params


def blocks_equal(p: LLMEngine, prid: str, d: LLMEngine, drid: str, upto: int) -> bool:
    preq, dreq = p.requests.get(prid), d.requests.get(drid)
    if preq is None or dreq is None or len(dreq.block_ids) < upto:
        return False
    src, dst = preq.block_ids[:upto], dreq.block_ids[:upto]
    return torch.equal(p.kv_cache.tensor[src], d.kv_cache.tensor[dst])


def free_and_unpinned(*engines) -> bool:
    return all(e.stats().num_free_blocks == e.stats().num_total_blocks and not e.has_pins for e in engines)


def test_blocks_cached_on_prefill_are_readable_at_admission_and_an_abort_cancels(ckpt, pair):
    p, d = pair
    p.generate([PROMPT[:20]], GREEDY)  # P's prefix cache now holds the prompt's first 5 blocks
    params = announce(p, "p0")  # admitted with those 5 ready, and its first chunk computed in that step
    d.add_request("d0", PROMPT, GREEDY, params)
    cached = 20 // BLOCK
    assert p.requests["p0"].num_cached_tokens == 20
    until(lambda: blocks_equal(p, "p0", d, "d0", cached), "the cached blocks on the decode side", [d])
    p.abort("p0")  # the prefill never finishes: the decode side is told, and gives up
    outs = until(lambda: "d0" not in d.requests, "the decode request to end", [p, d])
    ends = [o for o in outs if o.request_id == "d0" and o.finished]
    assert ends and ends[0].finish_reason == "abort" and not ends[0].new_token_ids
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])


def test_decode_aborted_mid_pull_releases_and_the_prefill_finishes_alone(ckpt, pair):
    p, d = pair
    fresh = [t + 600 for t in PROMPT]
    params = announce(p, "p2", fresh)
    d.add_request("d2", fresh, GREEDY, params)
    p.step()  # one chunk
    until(lambda: blocks_equal(p, "p2", d, "d2", CHUNK // BLOCK), "the first chunk on the decode side", [d])
    d.abort("d2")
    until(lambda: "d2" not in d.requests and free_and_unpinned(d), "the decode side freed", [d])
    outs = until(lambda: "p2" not in p.requests, "the prefill to finish", [p])
    assert [o for o in outs if o.request_id == "p2" and o.finished]
    until(lambda: free_and_unpinned(p), "the prefill's pin released and its blocks freed", [p, d])


def test_a_first_token_that_ends_the_request_cancels_the_hand_off(ckpt, pair):
    p, d = pair
    fresh = [t + 900 for t in PROMPT]
    first = engine_answer(ckpt, fresh)[0]
    params = announce(p, "p3", fresh, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first]))
    d.add_request("d3", fresh, GREEDY, params)
    outs = until(lambda: "p3" not in p.requests, "the prefill to finish", [p, d])
    fin = [o for o in outs if o.request_id == "p3" and o.finished][0]
    assert fin.finish_reason == "stop" and fin.kv_transfer_params is None
    outs = until(lambda: "d3" not in d.requests, "the decode request to end", [p, d])
    assert not [t for o in outs if o.request_id == "d3" for t in o.new_token_ids]
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])


def test_a_pull_that_times_out_before_the_first_token_prefills_locally(ckpt, pair):
    """The prefill is held (a busy prefill worker): the decode side's pull gives up after its
    timeout. The prefill may still finish and the router then streams its first token, so the
    decode side must not end the request: it prefills locally and reports the first token it
    samples as handed over (equal to the prefill's), then decodes the rest, the same answer."""
    p, _ = pair
    transport, asyn = p.config.kv_transfer, p.async_scheduling
    fresh = [t + 1200 for t in PROMPT]
    want = engine_answer(ckpt, fresh)
    d = engine(ckpt, "decode", transport, kv_pull_timeout=0.5, async_scheduling=asyn)
    try:
        params = announce(p, "p4", fresh)  # P is not stepped again until the decode side is done
        d.add_request("d4", fresh, GREEDY, params)
        mine, deadline = [], time.monotonic() + 30
        while not (mine and mine[-1].finished):
            assert time.monotonic() < deadline, "timed out waiting for the decode request to end"
            mine += [o for o in d.step() if o.request_id == "d4"]
        assert [o.handed_over_token_ids for o in mine if o.handed_over_token_ids] == [want[:1]]
        assert [t for o in mine for t in o.new_token_ids] == want[1:]
        assert mine[-1].finish_reason == "length"
        assert d.kv_connector.metrics.local_prefill_fallbacks._value.get() == 1
        p.abort("p4")
        until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])
    finally:
        d.shutdown()


def test_the_decode_side_hears_of_the_last_prefill_step_before_it_ends(ckpt, pair):
    """Once the prefill's remaining tokens fit one step, the decode side's pull knows its KV
    lands within about a step (pull_landing: an async engine stops overlapping steps so the
    request joins the step after the landing), while the last chunk is still not computed."""
    p, d = pair
    fresh = [t + 500 for t in PROMPT]
    want = engine_answer(ckpt, fresh)
    n_blocks = -(-len(fresh) // BLOCK)
    params = announce(p, "p6", fresh)
    d.add_request("d6", fresh, GREEDY, params)
    until(lambda: "d6" in d.kv_connector._loading, "the pull to start", [d])
    assert not d.kv_connector.pull_landing()
    while not p.kv_connector.pins.state("p6")["last"]:
        fin = [o for o in p.step() if o.request_id == "p6" and o.finished]
        assert not fin, "the prefill ended before its last step was announced"
    state = p.kv_connector.pins.state("p6")
    assert state["state"] == "running" and n_blocks - state["ready"] <= CHUNK // BLOCK + 1, state
    until(lambda: d.kv_connector.pull_landing(), "the decode side to hear of the last step")  # p held
    outs = until(lambda: "p6" not in p.requests, "the prefill to finish", [p])
    first = next(o for o in outs if o.request_id == "p6" and o.finished).new_token_ids[0]
    tokens = [first]
    outs = until(lambda: "d6" not in d.requests, "the decode request to end", [p, d])
    tokens += [t for o in outs if o.request_id == "d6" for t in o.new_token_ids]
    assert tokens == want
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])


def test_the_last_steps_layers_reach_the_decode_side_while_it_runs(ckpt, pair, monkeypatch):
    """The step that ends the prompt moves its blocks layer by layer (TCP: the stream read's
    senders send them; NIXL: the decode side READs the layers a progress reply says are
    written): with its forward held before layer 1, layer 0 of the prompt's last blocks
    (computed by that step alone) is on the decode side while the step has not ended; once it
    runs on, the answer is one worker's."""
    p, d = pair
    fresh = [t + 1200 for t in PROMPT]
    expected = engine_answer(ckpt, fresh)
    held, go = hold_the_last_step(monkeypatch, p, len(fresh))
    d.add_request("d9", fresh, GREEDY, announce(p, "p9", fresh))
    with prefill_on_a_thread(p, "p9", go) as outs:
        until(held.is_set, "the prefill's last step to reach layer 1", [d])
        last = list(range(len(PROMPT) // CHUNK * CHUNK // BLOCK, -(-len(fresh) // BLOCK)))  # its blocks alone
        src, dst = [p.requests["p9"].block_ids[i] for i in last], [d.requests["d9"].block_ids[i] for i in last]
        until(lambda: torch.equal(p.kv_cache.tensor[src, 0], d.kv_cache.tensor[dst, 0]),
              "layer 0 of the last step's blocks on the decode side", [d])
        assert p.kv_connector.pins.state("p9")["state"] == "running" and "p9" in p.requests
    first = next(o for o in outs if o.request_id == "p9" and o.finished).new_token_ids[0]
    assert decode_to_the_end(p, d, "d9", first) == expected


@contextlib.contextmanager
def prefill_on_a_thread(p: LLMEngine, prid: str, go: threading.Event):
    """Step `p` on a thread until request `prid` has finished (bounded generously: it outlasts a
    held forward), yielding the outputs as they come; on exit, `go` lets a held forward run on,
    and the thread is joined."""
    outs: list = []
    ended = lambda: any(o.request_id == prid and o.finished for o in outs)  # noqa: E731
    prefill = threading.Thread(target=lambda: until(lambda: outs.extend(p.step()) or ended(), "the prefill",
                                                    timeout=300))
    prefill.start()
    try:
        yield outs
    finally:
        go.set()
        prefill.join(60)


def hold_the_last_step(monkeypatch, p: LLMEngine, prompt_len: int) -> tuple[threading.Event, threading.Event]:
    """Hold `p`'s forward before layer 1 in the step that computes the prompt's last token:
    (held, go) — `held` is set once it waits there, `go` lets it run on."""
    layer = p.runner.model.layers[1]
    forward, held, go = layer.forward, threading.Event(), threading.Event()

    def holding_forward(positions, *args, **kw):
        if int(positions.max()) == prompt_len - 1 and not go.is_set():
            held.set()
            assert go.wait(60)
        return forward(positions, *args, **kw)

    monkeypatch.setattr(layer, "forward", holding_forward)
    return held, go


def decode_to_the_end(p: LLMEngine, d: LLMEngine, drid: str, first: int) -> list[int]:
    """Step `d` until `drid` ends; its tokens after the prefill's `first`, once every block of
    both engines is free and unpinned."""
    outs = until(lambda: drid not in d.requests, "the decode request to end", [d])
    tokens = [first] + [t for o in outs if o.request_id == drid for t in o.new_token_ids]
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])
    return tokens


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prompt_computed_in_one_step_moves_while_that_step_runs(ckpt, transport, monkeypatch):
    """Without a streamed split (--kv-stream-chunk-tokens 0) the prompt is computed in one step;
    the decode side starts reading once that step has written a layer (TCP: its stream read
    opens then, not once the step's blocks are collected; NIXL: it READs the written layers).
    With the forward held before layer 1, layer 0 of every block is on the decode side while
    the one step runs; then the answer is one worker's."""
    p = engine(ckpt, "prefill", transport, chunk=0)
    d = engine(ckpt, "decode", transport)
    try:
        fresh = [t + 1300 for t in PROMPT]
        expected = engine_answer(ckpt, fresh)
        held, go = hold_the_last_step(monkeypatch, p, len(fresh))
        announced: list = []
        p.on_announce = announced.extend  # the params leave before the step runs, as the server sends them
        p.add_request("p1", fresh, GREEDY, {"do_remote_decode": True, "stream_kv": True})
        with prefill_on_a_thread(p, "p1", go) as outs:
            until(held.is_set, "the prompt's one step to reach layer 1")
            params = next(o.kv_transfer_params for o in announced if o.request_id == "p1")
            assert p.kv_connector.pins.state("p1")["ready"] == 0  # nothing collected: the step runs
            d.add_request("d1", fresh, GREEDY, params)
            n = -(-len(fresh) // BLOCK)

            def layer0_landed() -> bool:
                dst = d.requests["d1"].block_ids[:n] if "d1" in d.requests else []
                return len(dst) == n and torch.equal(p.kv_cache.tensor[p.requests["p1"].block_ids[:n], 0],
                                                     d.kv_cache.tensor[dst, 0])

            until(layer0_landed, "layer 0 of every block on the decode side", [d])
            assert p.kv_connector.pins.state("p1")["state"] == "running" and "p1" in p.requests
        first = next(o for o in outs if o.request_id == "p1" and o.finished).new_token_ids[0]
        assert decode_to_the_end(p, d, "d1", first) == expected
    finally:
        p.shutdown()
        d.shutdown()


def hand_off_and_decode(p: LLMEngine, d: LLMEngine, prid: str, drid: str, prompt,
                        before_step=lambda: None) -> list[list[int]]:
    """Hands `prompt` off from `p` (`prid`) to `d` (`drid`), which the test keeps busy, and drives
    both engines to the end: `d` is stepped until the pull starts, then held while the prefill
    runs to its end, so that the pull's last read lands while `d` steps again (the test's hooks
    on `d` pin down when); then `d` is stepped until `drid` ends. Returns `drid`'s new tokens,
    one list per step of those last ones (empty where it had none), without the prefill's first
    token. `before_step` runs before each of those steps."""
    conn = d.kv_connector
    d.add_request(drid, prompt, GREEDY, announce(p, prid, prompt))
    until(lambda: drid in conn._loading, "the pull to start", [d])
    until(lambda: prid not in p.requests, "the prefill to finish", [p])  # d not stepped meanwhile
    until(lambda: drid in conn._landing, "the pull to learn that the prefill ended")  # its last read runs
    steps, deadline = [], time.monotonic() + 30
    while drid in d.requests:
        assert time.monotonic() < deadline, f"timed out waiting for {drid}"
        before_step()
        steps.append([t for o in d.step() if o.request_id == drid for t in o.new_token_ids])
    return steps


def keep_busy(d: LLMEngine, rid: str, offset: int) -> None:
    """`d` decodes request `rid` (200 tokens, its prompt PROMPT shifted by `offset`) from now on."""
    busy = [t + offset for t in PROMPT]
    d.add_request(rid, busy, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), None)
    until(lambda: rid in d.requests and d.requests[rid].num_computed_tokens > len(busy), f"{rid} decoding", [d])


def pull_ending_on(conn, rid: str, event: threading.Event, what: str):
    """`conn`'s streamed pull, whose end for request `rid` waits for `event` (`what` if it never comes)."""
    stream_pull = conn._stream_pull

    def gated_stream_pull(r, *a, **kw):
        n = stream_pull(r, *a, **kw)
        if r == rid:
            assert event.wait(30), what
        return n

    return gated_stream_pull


def test_a_hand_off_that_lands_during_a_step_joins_the_next_one(ckpt, pair, monkeypatch):
    """The decode worker is busy (another request decodes) when a hand-off's last read lands,
    during a step: the request must be in the very next step, under async scheduling too (there
    the next step is normally launched before the one in flight is collected; it would then wait
    a whole extra step: P/D's first gap). The landing is pinned to the collection of the step in
    flight: the pull's end waits for it, and the collection waits for the pull."""
    p, d = pair
    conn = d.kv_connector
    keep_busy(d, "a5", 1100)
    fresh = [t + 1300 for t in PROMPT]
    want = engine_answer(ckpt, fresh)
    landed = threading.Event()
    collect = d.runner.collect
    calls = {"n": 0, "landed": None}

    def collect_while_landing(step):
        if not landed.is_set() and "d5" in conn._landing:
            calls["landed"] = calls["n"]
            landed.set()
            wait([conn._loading["d5"]], timeout=30)
        return collect(step)

    monkeypatch.setattr(conn, "_stream_pull",
                        pull_ending_on(conn, "d5", landed, "no step was collected while the pull landed"))
    monkeypatch.setattr(d.runner, "collect", collect_while_landing)
    steps = hand_off_and_decode(p, d, "p5", "d5", fresh, before_step=lambda: calls.update(n=calls["n"] + 1))
    first_at = next((n for n, new in enumerate(steps, 1) if new), None)
    assert calls["landed"] is not None and first_at == calls["landed"] + 1, calls
    assert [want[0]] + [t for new in steps for t in new] == want
    d.abort("a5")
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])


def test_a_hand_off_that_lands_while_a_step_runs_joins_the_step_behind_it(ckpt, pair, monkeypatch):
    """Async scheduling: the decode worker is busy and the hand-off's last read lands while the
    device still runs the step in flight. The request must join the step planned then and
    launched behind that one (a late join), without collecting it first: overlap kept, no host
    gap on P/D's first gap. The device is stood in for (CPU steps run at launch): the step in
    flight reads as running until the pull has landed, and the pull's end waits until the engine
    waits on it (deterministic, no timing)."""
    p, d = pair
    if not d.async_scheduling:
        pytest.skip("a late join needs a step in flight (async scheduling)")
    conn = d.kv_connector
    keep_busy(d, "a6", 700)
    fresh = [t + 800 for t in PROMPT]
    want = engine_answer(ckpt, fresh)
    waiting = threading.Event()
    launch, is_done = d.runner.launch, d.runner.is_done
    launches = []  # (request ids in the batch, launched behind a step in flight)

    def running_until_landed(step):
        waiting.set()
        return is_done(step) and "d6" not in conn._loading

    def recorded_launch(batch, previous=None, **kw):
        launches.append(({r.request_id for r, _ in batch.items}, previous is not None))
        return launch(batch, previous, **kw)

    monkeypatch.setattr(conn, "_stream_pull",
                        pull_ending_on(conn, "d6", waiting, "the engine never waited for the landing"))
    monkeypatch.setattr(d.runner, "is_done", running_until_landed)
    monkeypatch.setattr(d.runner, "launch", recorded_launch)
    late_joins = d.num_late_joins
    tokens = [want[0]] + [t for new in hand_off_and_decode(p, d, "p6", "d6", fresh) for t in new]
    assert d.num_late_joins == late_joins + 1
    joined = next(i for i, (ids, _) in enumerate(launches) if "d6" in ids)
    assert launches[joined][1], "the landed request's first step was not launched behind the one in flight"
    assert "a6" in launches[joined - 1][0] and "d6" not in launches[joined - 1][0]
    assert tokens == want
    d.abort("a6")
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])


def count_ops(monkeypatch, p: LLMEngine) -> Counter:
    """Side-channel requests the prefill engine serves from now on, by op (deferred ones each time
    their handler runs)."""
    ops = Counter()
    for op, handler in list(p.kv_connector.server.handlers.items()):
        def counted(body, op=op, handler=handler):
            ops[op] += 1
            return handler(body)
        monkeypatch.setitem(p.kv_connector.server.handlers, op, counted)
    return ops


def record_timeline(monkeypatch, p: LLMEngine, rid: str) -> list[tuple]:
    """What happens to `rid` on the prefill engine, in order: ("launch", start, end) when a step
    computing its tokens start..end is launched, ("collect", end) when that step is collected
    (its KV written), ("advance", ready) when its pin is told `ready` leading blocks are readable."""
    events, ends = [], {}
    launch, collect, apply = p.runner.launch, p.runner.collect, p.kv_connector.apply

    def on_launch(batch, *a, **kw):
        mine = [(r.num_computed_tokens, r.num_computed_tokens + n) for r, n in batch.items if r.request_id == rid]
        step = launch(batch, *a, **kw)
        for start, end in mine:
            events.append(("launch", start, end))
            ends[id(step)] = end
        return step

    def on_collect(step):
        out = collect(step)
        if id(step) in ends:
            events.append(("collect", ends.pop(id(step))))
        return out

    def on_apply(meta):
        events.extend(("advance", ready) for r, ready in meta.advances if r == rid)
        return apply(meta)

    monkeypatch.setattr(p.runner, "launch", on_launch)
    monkeypatch.setattr(p.runner, "collect", on_collect)
    monkeypatch.setattr(p.kv_connector, "apply", on_apply)
    return events


def check_timeline(events: list[tuple], overlapped: bool) -> None:
    """No block is readable before the step that wrote it was collected; under async scheduling
    chunk k+1 is launched before chunk k's blocks are readable, synchronously only after."""
    assert sum(e[0] == "launch" for e in events) >= 3, events
    collected = 0
    for e in events:
        if e[0] == "collect":
            collected = max(collected, e[1])
        elif e[0] == "advance":
            assert e[1] * BLOCK <= collected, f"blocks readable before their step was collected: {events}"
    launches = [i for i, e in enumerate(events) if e[0] == "launch"]
    for k, k_next in zip(launches, launches[1:]):
        end = events[k][2]
        readable = next(i for i, e in enumerate(events) if e[0] == "advance" and e[1] >= end // BLOCK)
        assert (k_next < readable) == overlapped, events


def test_overlap_timeline_and_one_answer(ckpt, pair, monkeypatch):
    p, d = pair
    fresh = [t + 300 for t in PROMPT]  # not in either prefix cache
    expected = engine_answer(ckpt, fresh)
    events = record_timeline(monkeypatch, p, "p1")
    ops = count_ops(monkeypatch, p)
    params = announce(p, "p1", fresh)
    d.add_request("d1", fresh, GREEDY, params)
    n_blocks = -(-len(fresh) // BLOCK)
    outs, first = [], None
    done_blocks, in_flight = 0, False
    while first is None:
        step = p.step()  # one chunk (CHUNK tokens = 2 blocks) per step
        outs += step
        fin = [o for o in step if o.request_id == "p1" and o.finished]
        if fin:
            first = fin[0].new_token_ids[0]
            break
        # What the decode side may read now (async scheduling: not the chunk just launched).
        done_blocks = p.kv_connector.pins.state("p1")["ready"]
        in_flight |= p.requests["p1"].num_computed_tokens // BLOCK > done_blocks
        # Held here: the decode side must have every readable block before the next step.
        until(lambda: blocks_equal(p, "p1", d, "d1", done_blocks), f"blocks 0..{done_blocks} on the decode side",
              [d])
    assert 0 < done_blocks < n_blocks - 1, "the prefill ran in one step: no chunk to overlap"
    assert in_flight == p.async_scheduling  # the decode side read chunk k while chunk k+1 was launched
    check_timeline(events, p.async_scheduling)
    tokens = [first]
    deadline = time.monotonic() + 60
    while "d1" in d.requests:
        assert time.monotonic() < deadline
        for o in d.step():
            if o.request_id == "d1":
                assert o.handed_over_token_ids in (None, [first])
                tokens += o.new_token_ids
        p.step()
    assert tokens == expected
    # Counted on the side channel's thread: read once the pull has ended (d1 finished), not while
    # its last progress may still be in flight.
    if p.config.kv_transfer == "nixl":  # every progress reply leased its chunk: no lease round trips
        assert ops["lease"] == 0 and ops["progress"] >= 3, ops
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])


def engine_answer(ckpt, prompt) -> list[int]:
    e = make_engine(ckpt, block_size=BLOCK, kv_cache_memory=8 << 20, max_model_len=256)
    try:
        return e.generate([prompt], GREEDY)[0]
    finally:
        e.shutdown()


@pytest.mark.parametrize("asyn", [False, True], ids=["sync", "async"])
def test_the_tail_split_runs_the_prompt_in_two_steps_the_last_chunk_alone(ckpt, asyn):
    """--kv-stream-split tail: everything but the last CHUNK tokens in one step (the budget allows
    it), readable by the decode side before the tail is computed; the tail, then the first token.
    Async scheduling: the head is readable once the tail is launched (the tail runs while the
    head is read)."""
    p = engine(ckpt, "prefill", "tcp", split="tail", async_scheduling=asyn)
    d = engine(ckpt, "decode", "tcp", async_scheduling=asyn)
    try:
        fresh = [t + 1200 for t in PROMPT]
        params = announce(p, "p4", fresh)  # admitted, and its first step run (or launched): all but the tail
        assert p.requests["p4"].num_computed_tokens == len(fresh) - CHUNK
        d.add_request("d4", fresh, GREEDY, params)
        head = (len(fresh) - CHUNK) // BLOCK
        if asyn:
            assert p.kv_connector.pins.state("p4")["ready"] == 0  # the head is launched, not yet collected
            assert not [o for o in p.step() if o.request_id == "p4"]  # the tail launched, the head collected
            assert p.requests["p4"].num_computed_tokens == len(fresh)
            assert p.kv_connector.pins.state("p4")["ready"] == head
        until(lambda: blocks_equal(p, "p4", d, "d4", head), "the head's blocks on the decode side", [d])
        fin = [o for o in p.step() if o.request_id == "p4" and o.finished]
        assert fin and fin[0].new_token_ids, "the tail and the first token take exactly one more step"
        tokens = [fin[0].new_token_ids[0]]
        deadline = time.monotonic() + 60
        while "d4" in d.requests:
            assert time.monotonic() < deadline
            tokens += [t for o in d.step() if o.request_id == "d4" for t in o.new_token_ids]
            p.step()
        assert tokens == engine_answer(ckpt, fresh)
    finally:
        p.shutdown()
        d.shutdown()


def test_the_taper_split_halves_the_chunks_towards_the_tail(ckpt):
    """--kv-stream-split taper: 60 tokens, chunk 8 -> steps of 36, 16 and 8 tokens, each
    readable by the decode side once computed; the answer is one worker's."""
    p = engine(ckpt, "prefill", "tcp", split="taper")
    d = engine(ckpt, "decode", "tcp")
    try:
        fresh = list(range(1400, 1460))
        params = announce(p, "p7", fresh)  # admitted, and its first chunk computed in that step
        computed = [p.requests["p7"].num_computed_tokens]
        d.add_request("d7", fresh, GREEDY, params)
        until(lambda: blocks_equal(p, "p7", d, "d7", computed[0] // BLOCK), "the first chunk on the decode side", [d])
        tokens = []
        while "p7" in p.requests:
            for o in p.step():
                if o.request_id == "p7" and o.finished:
                    tokens = o.new_token_ids[:1]
            if "p7" in p.requests:
                computed.append(p.requests["p7"].num_computed_tokens)
        assert computed == [36, 52], computed  # then the last 8 with the first token
        deadline = time.monotonic() + 60
        while "d7" in d.requests:
            assert time.monotonic() < deadline
            tokens += [t for o in d.step() if o.request_id == "d7" for t in o.new_token_ids]
        assert tokens == engine_answer(ckpt, fresh)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_decode_starts_a_pull_only_after_the_step_in_flight(ckpt, transport, monkeypatch):
    """Decode side under async scheduling: a request admitted for a pull while a step is in
    flight gets blocks that step may still write (freed since it was launched: a request it
    decodes finished or was preempted); its pull starts once that step was collected, and the
    request is not scheduled before the pull lands. The answer is one worker's."""
    p = engine(ckpt, "prefill", transport, async_scheduling=True)
    d = engine(ckpt, "decode", transport, async_scheduling=True)
    try:
        fresh = [t + 1350 for t in PROMPT]
        p.add_request("p5", fresh, GREEDY, {"do_remote_decode": True})  # a plain (after-prefill) hand-off
        outs = []
        deadline = time.monotonic() + 30
        while not any(o.request_id == "p5" and o.finished for o in outs):
            assert time.monotonic() < deadline, "the prefill did not finish"
            outs += p.step()
        params = next(o for o in outs if o.request_id == "p5" and o.finished).kv_transfer_params
        d.add_request("busy", PROMPT[:9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        until(lambda: d._in_flight is not None and d.requests["busy"].num_output_tokens > 0,
              "a decode step in flight", [d])
        events = []
        collect, apply, launch = d.runner.collect, d.kv_connector.apply, d.runner.launch
        monkeypatch.setattr(d.runner, "collect", lambda step: (events.append("collect"), collect(step))[1])
        monkeypatch.setattr(d.kv_connector, "apply",
                            lambda meta: (events.extend(["pull"] * len(meta.loads)), apply(meta))[1])
        monkeypatch.setattr(d.runner, "launch", lambda batch, *a, **kw: (
            events.append("launch with d5" if any(r.request_id == "d5" for r, _ in batch.items) else "launch"),
            launch(batch, *a, **kw))[1])
        d.add_request("d5", fresh, GREEDY, params)
        tokens, done = [params.first_token_id], False
        deadline = time.monotonic() + 60
        while not done:
            assert time.monotonic() < deadline
            for o in d.step():
                if o.request_id == "d5":
                    tokens += o.new_token_ids
                    done = o.finished
        assert events[:3] == ["launch", "collect", "pull"], events  # admitted; pulled after the collect
        assert events.index("launch with d5") > events.index("pull")
        assert tokens == engine_answer(ckpt, fresh)
        until(lambda: "busy" not in d.requests, "the other request to finish", [d])
        until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])
    finally:
        p.shutdown()
        d.shutdown()


def test_a_streamed_pulls_debug_lines_account_for_its_bytes(ckpt, pair, caplog, tmp_path, capsys):
    """With debug logs, the lines `pdserve bench pull-timeline` reads account for a streamed pull:
    its tail line names both requests, and over NIXL its layered READs before and after the
    prefill's end add up to the bytes the pull moved."""
    from pdserve.bench import pull_timeline

    p, d = pair
    fresh = [t + 1000 for t in PROMPT]
    expected = engine_answer(ckpt, fresh)
    caplog.set_level(logging.DEBUG, logger="pdserve.worker.kv")
    d.add_request("d20", fresh, GREEDY, announce(p, "p20", fresh))
    outs: list = []
    ended = lambda: any(o.request_id == "d20" and o.finished for o in outs)  # noqa: E731
    until(lambda: outs.extend(p.step() + d.step()) or ended(), "the hand-off and the decode to end")
    first = next(o for o in outs if o.request_id == "p20" and o.finished).new_token_ids[0]
    assert [first] + [t for o in outs if o.request_id == "d20" for t in o.new_token_ids] == expected
    until(lambda: free_and_unpinned(p, d), "every block freed and unpinned", [p, d])
    pulls = [x for x in pull_timeline.parse(r.getMessage() for r in caplog.records) if x.request_id == "d20"]
    assert len(pulls) == 1 and pulls[0].prefill_id == "p20" and pulls[0].replies >= 1, pulls
    pull = pulls[0]
    assert pull.mib > 0 and pull.tail_ms >= 0
    if p.config.kv_transfer == "nixl":
        reads = pull.reads.count + pull.tail.count
        assert reads >= 1 and abs(pull.reads.mib + pull.tail.mib - pull.mib) <= 0.0005 * (reads + 1), pull
    (tmp_path / "decode-0.log").write_text("".join(f"2026-12-06 01:00:00,000 DEBUG {r.name}: {r.getMessage()}\n"
                                                   for r in caplog.records))
    assert pull_timeline.main([str(tmp_path)]) == 0  # a folder of logs, as `pdserve up --log-dir` writes
    table = capsys.readouterr().out
    assert table.count("\n") == 3 and f"| d20 | {pull.mib:.1f} |" in table
