"""--async-scheduling gives the synchronous engine's outputs token for token (fp32, CPU).

On CPU every "device" operation finishes before it returns, so nothing actually overlaps here;
what is tested is the structure: step n+1 is scheduled and launched before step n's tokens are
read back (counted by `num_overlapped_steps`), its decodes take step n's tokens from the
device tensor, a token computed for a request that step n already finished is dropped
(`num_dropped_tokens`), and the steps that need the host first (penalties, grammars, prompt
logprobs) run synchronously. Each engine is compared with a synchronous engine over the same
checkpoint and requests: the outputs (tokens, finish reasons, logprobs, prompt logprobs) must
be equal, and no KV block may leak.
"""

from __future__ import annotations


from pdserve.worker.engine.llm_engine import LLMEngine, wants_async_scheduling
from pdserve.worker.request.sampling_params import SamplingParams, StructuredOutputSpec
from tests.helpers.engines import make_engine
from tests.net import free_port

PROMPTS = [
    [5, 17, 300, 42, 9, 1000, 77],
    list(range(100, 137)),  # longer than several blocks
    [3, 4],
    [900 + 7 * i for i in range(19)],
    [11] * 9,
]


def drive(engine: LLMEngine, arrivals, abort_after: dict[str, int] | None = None, max_steps: int = 2000):
    """Run `arrivals` [(step, request id, prompt, params)] to the end: each request is added when
    the engine has taken that many steps; a request in `abort_after` is aborted once it has
    that many tokens. -> {request id: (tokens, finish reason, logprobs, prompt logprobs)}."""
    abort_after = abort_after or {}
    out: dict[str, list] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    done: set[str] = set()
    aborted: set[str] = set()
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            out[rid] = [[], None, [], None]
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            rec = out[o.request_id]
            assert o.request_id not in done, f"{o.request_id}: output after its final one"
            rec[0] += o.new_token_ids
            rec[2] += [(lp.token_id, round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top])
                       for lp in (o.logprobs or [])]
            if o.prompt_logprobs is not None:
                rec[3] = [None if lp is None else (lp.token_id, round(lp.logprob, 4)) for lp in o.prompt_logprobs]
            if o.finished:
                rec[1] = o.finish_reason
                done.add(o.request_id)
        for rid, n in abort_after.items():
            if rid not in aborted and rid not in done and len(out.get(rid, [[]])[0]) >= n:
                engine.abort(rid)
                aborted.add(rid)
        step += 1
        assert step < max_steps, "the engine did not finish"
    assert done == set(out), f"unfinished: {set(out) - done}"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    return {rid: tuple(map(lambda v: tuple(v) if isinstance(v, list) else v, rec)) for rid, rec in out.items()}


def both(ckpt, arrivals, **kw):
    sync, asyn = make_engine(ckpt, async_scheduling=False, **kw), make_engine(ckpt, async_scheduling=True, **kw)
    assert not sync.async_scheduling and asyn.async_scheduling
    a, b = drive(sync, arrivals), drive(asyn, arrivals)
    assert sync.num_overlapped_steps == 0
    return a, b, asyn


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_the_default_is_on_with_a_gpu_and_off_on_cpu(tiny_checkpoint):
    """Unset, async scheduling follows the device (a GPU engine is not built here: the rule is
    checked as the function the engine calls, and a CPU engine's outcome for real)."""
    assert wants_async_scheduling(None, "cuda", False, False)
    assert wants_async_scheduling(None, "cuda", False, True)  # P/D on one GPU
    assert not wants_async_scheduling(None, "cuda", True, True)  # P/D under TP: not tested yet
    assert wants_async_scheduling(None, "cuda", True, False)
    assert not wants_async_scheduling(None, "cpu", False, False)
    assert wants_async_scheduling(True, "cpu", False, False) and not wants_async_scheduling(False, "cuda", False, False)
    engine = make_engine(tiny_checkpoint())
    try:
        assert engine.config.async_scheduling is None and not engine.async_scheduling
    finally:
        engine.shutdown()


def test_greedy_and_seeded_mix_with_staggered_arrivals(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    arrivals = [
        (0, "g-long", PROMPTS[1], greedy(20, ignore_eos=True)),
        (0, "g-one", PROMPTS[2], greedy(1, ignore_eos=True)),  # finishes at its prefill
        (1, "seed-a", PROMPTS[0], SamplingParams(max_tokens=11, temperature=0.9, seed=7)),
        (1, "seed-b", PROMPTS[0], SamplingParams(max_tokens=11, temperature=0.9, seed=8, top_p=0.8)),
        (3, "seed-topk", PROMPTS[3], SamplingParams(max_tokens=9, temperature=1.2, seed=3, top_k=5)),
        (5, "g-min", PROMPTS[4], greedy(6, min_tokens=4)),
        (7, "g-late", PROMPTS[3], greedy(5, ignore_eos=True)),
    ]
    ref, got, engine = both(ckpt, arrivals)
    assert got == ref
    assert [len(ref[r][0]) for r in ("g-long", "g-one", "g-late")] == [20, 1, 5]
    assert engine.num_overlapped_steps > 5  # the steady decode steps were launched ahead


def test_stop_tokens_drop_the_token_computed_after_the_stop(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen2")
    free = make_engine(ckpt, async_scheduling=False).generate(PROMPTS[:2], greedy(16, ignore_eos=True))
    # Stop on each request's 5th token: both stop mid-stream while their next step is in flight.
    stops = [next(t for t in f[4:] if t not in f[:4]) for f in free]
    arrivals = [(0, f"s{i}", p, greedy(16, ignore_eos=True, stop_token_ids=(s,))) for i, (p, s) in
                enumerate(zip(PROMPTS[:2], stops))]
    arrivals.append((0, "runs-on", PROMPTS[2], greedy(16, ignore_eos=True)))
    ref, got, engine = both(ckpt, arrivals)
    assert got == ref
    for i, s in enumerate(stops):
        assert ref[f"s{i}"][0][-1] == s and ref[f"s{i}"][1] == "stop"
    assert engine.num_dropped_tokens >= 2


def test_logprobs_and_prompt_logprobs(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    arrivals = [
        (0, "lp", PROMPTS[0], greedy(8, ignore_eos=True, logprobs=3)),
        (0, "lp-seeded", PROMPTS[3], SamplingParams(max_tokens=8, temperature=0.7, seed=1, logprobs=0)),
        (2, "echo", PROMPTS[1], greedy(4, ignore_eos=True, prompt_logprobs=2)),  # steps with it run synchronously
        (0, "plain", PROMPTS[2], greedy(12, ignore_eos=True)),
    ]
    ref, got, _ = both(ckpt, arrivals)
    assert got == ref
    assert len(ref["lp"][2]) == 8 and len(ref["echo"][3]) == len(PROMPTS[1])


def test_host_dependent_sampling_falls_back_and_matches(tiny_checkpoint):
    # Penalties need the previous token on the host; a grammar advances there: their steps are
    # finished before the next is planned, while other requests share the batch.
    ckpt = tiny_checkpoint("llama")
    arrivals = [
        (0, "pen", PROMPTS[0], greedy(10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5)),
        (0, "rep", PROMPTS[3], greedy(10, ignore_eos=True, repetition_penalty=1.3)),
        (0, "bias", PROMPTS[2], greedy(10, ignore_eos=True, logit_bias=((17, 5.0),))),
        (0, "plain", PROMPTS[1], greedy(14, ignore_eos=True)),
        (4, "regex", PROMPTS[4], greedy(8, structured=StructuredOutputSpec("regex", "[a-z]+", "guided_regex"))),
    ]
    ref, got, engine = both(ckpt, arrivals)
    assert got == ref
    assert ref["regex"][0]  # the grammar let it produce something


def test_preemption_under_a_tiny_kv_cache(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3")
    per_block = make_engine(ckpt, async_scheduling=False).kv_cache.block_bytes
    # 16 blocks x 4 tokens cannot hold all the sequences at once: requests are preempted and
    # recomputed, some while a token of theirs is in flight.
    kw = dict(kv_cache_memory=16 * per_block, enable_prefix_caching=False, max_model_len=64)
    arrivals = [(i // 2, f"r{i}", p, greedy(12, ignore_eos=True) if i % 2 else
                 SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    sync, asyn = make_engine(ckpt, async_scheduling=False, **kw), make_engine(ckpt, async_scheduling=True, **kw)
    ref, got = drive(sync, arrivals), drive(asyn, arrivals)
    assert got == ref
    assert sync.stats().num_preemptions > 0 and asyn.stats().num_preemptions > 0
    assert asyn.num_overlapped_steps > 0


def test_chunked_prefill_mixed_with_decodes(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    arrivals = [(i, f"r{i}", p, greedy(10, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    ref, got, engine = both(ckpt, arrivals, max_num_batched_tokens=5)
    assert got == ref
    assert engine.num_overlapped_steps > 0


def test_max_model_len_ends_requests_without_overrunning(tiny_checkpoint):
    # The step that would run past the context limit is never scheduled ahead.
    ckpt = tiny_checkpoint("llama")
    arrivals = [
        (0, "long", PROMPTS[1], greedy(100, ignore_eos=True)),
        (0, "short", PROMPTS[2], greedy(100, ignore_eos=True)),
    ]
    ref, got, _ = both(ckpt, arrivals, max_model_len=48)
    assert got == ref
    assert ref["long"][1] == "length" and len(PROMPTS[1]) + len(ref["long"][0]) == 48


def test_abort_mid_stream(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    full = make_engine(ckpt, async_scheduling=False).generate(PROMPTS[:3], greedy(20, ignore_eos=True))
    for async_scheduling in (False, True):
        engine = make_engine(ckpt, async_scheduling=async_scheduling)
        arrivals = [(0, f"r{i}", p, greedy(20, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
        got = drive(engine, arrivals, abort_after={"r0": 3, "r2": 1})
        for i in (0, 2):
            tokens, reason = got[f"r{i}"][:2]
            assert reason == "abort" and list(tokens) == full[i][:len(tokens)] and len(tokens) < 20
        assert got["r1"][:2] == (tuple(full[1]), "length")  # its neighbours' aborts do not touch it


def test_decode_graph_path_takes_tokens_from_the_device(tiny_checkpoint):
    # The CUDA-graph static-buffer path (run eagerly on CPU under the Triton interpreter): the
    # step's token row is filled from the previous step's tokens after the host copy.
    ckpt = tiny_checkpoint("llama")
    params = [greedy(m, ignore_eos=True) for m in (7, 4, 2)]
    engines = [make_engine(ckpt, attention_backend="triton", static_decode=True, max_model_len=64, max_num_seqs=4,
                           async_scheduling=a) for a in (False, True)]
    ref, got = (e.generate(PROMPTS[:3], params) for e in engines)
    assert got == ref and [len(t) for t in got] == [7, 4, 2]
    assert engines[1].runner.graphs.num_replays > 0 and engines[1].num_overlapped_steps > 0


def test_kv_transfer_engine_overlaps_and_matches(tiny_checkpoint):
    # A worker with --kv-transfer (a KV connector, its side channel) serves plain requests with
    # async scheduling as one without (P/D hand-offs: test_streamed_handoff.py, tests/router/test_pd_async.py).
    ckpt = tiny_checkpoint("llama")
    arrivals = [(0, "a", PROMPTS[1], greedy(9, ignore_eos=True)),
                (1, "b", PROMPTS[0], SamplingParams(max_tokens=7, temperature=0.9, seed=3, ignore_eos=True)),
                (3, "c", PROMPTS[3], greedy(5))]
    engines = [make_engine(ckpt, async_scheduling=a, kv_transfer="tcp", kv_port=free_port(),
                           kv_peer_allow=("127.0.0.1",)) for a in (False, True)]
    try:
        assert not engines[0].async_scheduling and engines[1].async_scheduling
        ref, got = (drive(e, arrivals) for e in engines)
        assert got == ref and engines[1].num_overlapped_steps > 0
    finally:
        for e in engines:
            e.shutdown()
