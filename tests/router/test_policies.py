"""Each policy against a table of worker states -> expected pick (pure, no processes)."""

from __future__ import annotations

import pytest

from pdserve.router import policies
from pdserve.protocol.kv_events import block_stored
from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
from pdserve.router.kv_index import KVIndex
from pdserve.router.policies import PolicyContext, RoutingRequest
from pdserve.router.workers import Worker

ANY = CompletionRequest(model="m", prompt="x")  # what the policies below do not look at


def pool(*states: dict) -> list[Worker]:
    out = []
    for i, s in enumerate(states):
        w = Worker(f"http://10.0.0.{i}:8000", "decode")
        for k, v in s.items():
            setattr(w, k, v)
        out.append(w)
    return out


def pick(name: str, workers, request=None, ctx=PolicyContext()) -> int:
    policy = policies.create(name, ctx)
    return workers.index(policy.choose(workers, request or RoutingRequest(ANY)))


def test_registry_lists_builtins_and_rejects_unknown():
    assert {"round-robin", "least-loaded", "prefix-aware", "session-affinity"} <= set(policies.available())
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        policies.create("nope", PolicyContext())


def test_round_robin_cycles_in_url_order():
    workers = pool({}, {}, {})
    policy = policies.create("round-robin", PolicyContext())
    picks = [workers.index(policy.choose(workers, RoutingRequest(ANY))) for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert workers.index(policy.choose(list(reversed(workers)), RoutingRequest(ANY))) == 0  # order-independent


@pytest.mark.parametrize("states,expected", [
    ([{"inflight": 3}, {"inflight": 1}, {"inflight": 2}], 1),
    ([{"inflight": 0, "num_waiting": 5}, {"inflight": 2, "num_waiting": 0}], 1),  # queue counts as load
    ([{"inflight": 1, "kv_usage": 0.9}, {"inflight": 1, "kv_usage": 0.2}], 1),  # tie -> emptier KV cache
    ([{"inflight": 1, "kv_usage": 0.5}, {"inflight": 1, "kv_usage": 0.5}], 0),  # full tie -> first
    ([{"inflight": 0}], 0),
])
def test_least_loaded(states, expected):
    assert pick("least-loaded", pool(*states)) == expected


@pytest.mark.parametrize("session,states,expected", [
    (None, [{"inflight": 2}, {"inflight": 0}], 1),  # no header -> least-loaded
    ("", [{"inflight": 2}, {"inflight": 0}], 1),
])
def test_session_affinity_without_header(session, states, expected):
    assert pick("session-affinity", pool(*states), RoutingRequest(ANY, session_id=session)) == expected


def test_session_affinity_is_sticky_and_moves_only_lost_sessions():
    workers = pool({}, {}, {}, {})
    policy = policies.create("session-affinity", PolicyContext())
    sessions = [f"user-{i}" for i in range(200)]
    first = {s: policy.choose(workers, RoutingRequest(ANY, session_id=s)) for s in sessions}
    assert len(set(map(id, first.values()))) == 4  # spreads over every worker
    workers[0].inflight = 50  # load does not break affinity
    assert all(policy.choose(workers, RoutingRequest(ANY, session_id=s)) is first[s] for s in sessions)
    survivors = workers[1:]
    moved = [s for s in sessions if policy.choose(survivors, RoutingRequest(ANY, session_id=s)) is not first[s]]
    assert moved and all(first[s] is workers[0] for s in moved)  # only the lost worker's sessions move


BS = 4
TOKENS = list(range(100, 116))  # 4 blocks of 4


def index_with(cached: dict[int, int]) -> KVIndex:
    """Worker i holds the first cached[i] blocks of TOKENS."""
    index = KVIndex()
    for i, n in cached.items():
        index.apply(f"http://10.0.0.{i}:8000", [block_stored([i * 1000 + b for b in range(n)], None,
                                                             TOKENS[:n * BS], BS)])
    return index


@pytest.mark.parametrize("cached,states,tokens,expected", [
    ({0: 1, 1: 3}, [{}, {}, {}], TOKENS, 1),  # longest cached prefix wins
    ({0: 2, 1: 2}, [{"inflight": 3}, {"inflight": 1}], TOKENS, 1),  # equal prefix -> less load
    ({}, [{"inflight": 3}, {"inflight": 1}], TOKENS, 1),  # nothing cached -> least-loaded
    ({0: 4}, [{"inflight": 1}, {}], [1, 2, 3, 4, 5, 6, 7, 8], 1),  # another prompt: no match -> least-loaded
    ({1: 4}, [{}, {"inflight": 20}], TOKENS, 0),  # a hot worker loses its cache advantage
    ({1: 4}, [{}, {"inflight": 5}], TOKENS, 1),  # ...but a modest imbalance does not
    ({0: 4}, [{"inflight": 1}, {}], None, 1),  # no token ids (no tokenizer) -> least-loaded
])
def test_prefix_aware(cached, states, tokens, expected):
    ctx = PolicyContext(kv_index=index_with(cached))
    request = RoutingRequest(ANY, tokenize=lambda body: tokens)
    assert pick("prefix-aware", pool(*states), request, ctx) == expected


def test_prefix_aware_needs_the_index():
    with pytest.raises(ValueError, match="KV event index"):
        policies.create("prefix-aware", PolicyContext())


# ---- the rest of the pipeline: pool filters, the P/D decider, profile filters, pickers --------

from pdserve.router.policies import PoolQuery, plugin  # noqa: E402
from pdserve.router.selection import Selector  # noqa: E402


def worker(url="http://w:1", role="decode", revision=None, **state) -> Worker:
    w = Worker(url, role, revision)
    for k, v in state.items():
        setattr(w, k, v)
    return w


@pytest.mark.parametrize("name,workers,query,kept", [
    ("role", [worker(role="prefill"), worker(role="decode")], PoolQuery("decode", "m"), [1]),
    ("health", [worker(healthy=False), worker(), worker(ejected_until=float("inf"))], PoolQuery("decode", "m"), [1]),
    ("model", [worker(models=frozenset({"a"})), worker(models=frozenset({"m"})), worker()], PoolQuery("decode", "m"),
     [1, 2]),  # a worker whose models are not probed yet is not excluded
    # A hand-off's decode leg for adapter "sql" of base "m": workers that load adapters on demand qualify.
    ("model", [worker(models=frozenset({"m", "sql"})), worker(models=frozenset({"m"}), lora_loading=True),
               worker(models=frozenset({"m"})), worker(models=frozenset({"x"}), lora_loading=True)],
     PoolQuery("decode", "sql", loads_for="m"), [0, 1]),
    ("model", [worker(models=frozenset({"m", "sql"})), worker(models=frozenset({"m"}), lora_loading=True)],
     PoolQuery("decode", "sql"), [0]),  # not a hand-off: only the workers serving it
    ("revision", [worker(revision="r1"), worker(revision="r2"), worker()], PoolQuery("decode", "m"), [0, 1, 2]),
    ("revision", [worker(revision="r1"), worker(revision="r2"), worker()],
     PoolQuery("decode", "m", partners=[worker(role="prefill", revision="r2")]), [1, 2]),
    ("revision", [worker(revision="r1"), worker(revision="r2")],
     PoolQuery("prefill", "m", partners=[worker(revision=None)]), [0, 1]),  # unlabelled pairs with all
    ("revision", [worker(revision="r1"), worker()], PoolQuery("prefill", "m", partners=[]), []),  # no decode worker
    ("revision", [worker(revision="r1"), worker(revision="r2"), worker(revision="r3"), worker()],
     PoolQuery("decode", "m", partners=[worker(role="prefill", revision="r3"), worker(role="prefill", revision="r1")]),
     [0, 2, 3]),  # any partner's revision
])
def test_pool_filters(name, workers, query, kept):
    f = plugin("pool-filter", name, PolicyContext())
    assert [workers.index(w) for w in f.filter(workers, query)] == kept


@pytest.mark.parametrize("body,min_tokens,expected", [
    ({"prompt": "x" * 400}, 0, True),
    ({"prompt": "x" * 400}, 101, False),  # ~100 tokens estimated
    ({"prompt": "x" * 400}, 100, True),
    ({"prompt": "x" * 400, "n": 2}, 0, False),  # n > 1 is served by one worker
    ({"prompt": "x", "max_tokens": 1}, 0, False),  # nothing left to hand off
    ({"prompt": "x" * 400, "echo": True, "logprobs": 1, "max_tokens": 5}, 0, False),  # prompt logprobs: one worker
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1}, 0, False),
    ({"messages": [{"role": "user", "content": "x" * 40}]}, 14, True),  # 10 + 4 per message
])
def test_prompt_length_decider(body, min_tokens, expected):
    decider = plugin("decider", "prompt-length", PolicyContext(pd_min_prompt_tokens=min_tokens))
    request = (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)
    assert decider.disaggregate(request) is expected


@pytest.mark.parametrize("loads,kept", [
    ([0, 8, 9], [0, 1]),
    ([20, 12, 30], [0, 1]),
    ([5], [0]),
])
def test_load_headroom_filter(loads, kept):
    workers = [worker(f"http://w:{i}", inflight=n) for i, n in enumerate(loads)]
    f = plugin("filter", "load-headroom", PolicyContext())
    assert [workers.index(w) for w in f.filter(workers, RoutingRequest(ANY))] == kept


def test_round_robin_picker_rotates_among_the_best_scored_only():
    workers = [worker(f"http://w:{i}") for i in range(4)]
    picker = plugin("picker", "round-robin", PolicyContext())
    scores = [(1.0,), (0.0,), (1.0,), (1.0,)]
    assert [workers.index(picker.pick(workers, scores)) for _ in range(4)] == [0, 2, 3, 0]


def test_max_score_picker_compares_scores_in_scorer_order():
    workers = [worker(f"http://w:{i}") for i in range(3)]
    picker = plugin("picker", "max-score", PolicyContext())
    assert picker.pick(workers, [(1.0, -5.0), (1.0, -1.0), (0.0, 0.0)]) is workers[1]
    assert picker.pick(workers, [(1.0, 0.0), (1.0, 0.0), (1.0, 0.0)]) is workers[0]  # full tie: list order


def test_unknown_plugin_names_its_kind():
    with pytest.raises(ValueError, match="unknown scorer plugin 'nope'.*load"):
        plugin("scorer", "nope", PolicyContext())


def test_selector_pairs_decode_with_the_prefill_revision():
    from pdserve.router.config import RouterConfig
    from pdserve.router.workers import WorkerSet, WorkerSpec

    ws = WorkerSet(3, 1.0, 30.0)
    ws.update([WorkerSpec("http://p1:1", "prefill", "r1"), WorkerSpec("http://p2:1", "prefill", "r2"),
               WorkerSpec("http://d1:1", "decode", "r1"), WorkerSpec("http://d3:1", "decode", "r3")])
    sel = Selector(RouterConfig(decode_urls=("http://x:1",)), PolicyContext(), ws)
    decode = sel.pool("decode", "m")
    assert [w.url for w in decode] == ["http://d1:1", "http://d3:1"]
    prefill = sel.pool("prefill", "m", partners=decode)
    assert [w.url for w in prefill] == ["http://p1:1"]  # r2 has no decode worker
    assert [w.url for w in sel.pool("decode", "m", partners=prefill)] == ["http://d1:1"]


def test_selector_pools_in_one_pass_keep_what_the_filters_keep():
    """The built-in filters' pools made in one pass (Selector.pool) are the filter pipeline's,
    in its order, for every role, model and partner set."""
    from itertools import product

    from pdserve.router.config import RouterConfig
    from pdserve.router.workers import WorkerSet, WorkerSpec

    ws = WorkerSet(3, 1.0, 30.0)
    specs = [WorkerSpec(f"http://{role[0]}{i}:1", role, rev) for i, (role, rev, _) in
             enumerate(product(("prefill", "decode"), (None, "r1", "r2"), range(3)))]
    ws.update(specs)
    for i, w in enumerate(ws.all()):
        w.healthy = i % 7 != 1
        w.ejected_until = float("inf") if i % 5 == 2 else 0.0
        w.models = (frozenset(), frozenset({"m"}), frozenset({"other"}), frozenset({"m", "other"}))[i % 4]
    sel = Selector(RouterConfig(decode_urls=("http://x:1",)), PolicyContext(), ws)
    assert sel._built_in
    piped = Selector(RouterConfig(decode_urls=("http://x:1",)), PolicyContext(), ws)
    piped._built_in = False  # every filter in turn
    workers = ws.all()
    partner_sets = [None, [], workers[:1], workers[3:4], workers[6:7], workers[3:9], workers[12:15]]
    for role, model, partners in product(("prefill", "decode"), ("m", "other", "none"), partner_sets):
        assert sel.pool(role, model, partners) == piped.pool(role, model, partners), (role, model, partners)
    for model in ("m", "other", "none"):  # both roles' pools in one pass, as each alone
        assert sel.pools(model) == piped.pools(model) == (piped.pool("prefill", model), piped.pool("decode", model))


def test_prefix_aware_token_ids_are_computed_once_and_off_the_event_loop():
    """Issue 23: prefix-aware hashes token ids, and an 8 MB prompt tokenized on the router's event
    loop stalls every request and /health. The router computes them on a thread before selection;
    the policies' synchronous token_ids() then reuses them."""
    import asyncio
    import threading

    calls = []

    def tokenize(body):
        calls.append(threading.get_ident())
        return [1, 2, 3]

    async def main():
        routing = RoutingRequest(CompletionRequest(prompt="x"), None, tokenize)
        await routing.tokenize_off_loop()
        return threading.get_ident(), routing

    loop_thread, routing = asyncio.run(main())
    assert routing.token_ids() == [1, 2, 3]
    assert len(calls) == 1 and calls[0] != loop_thread


LORA_REQUEST = RoutingRequest(CompletionRequest(model="sql", prompt="x"))


@pytest.mark.parametrize("states,expected", [
    # Already in a slot beats idler workers (within the load headroom).
    ([{"inflight": 0, "max_lora": 2}, {"inflight": 3, "max_lora": 2, "lora_running": frozenset({"sql"})}], 1),
    ([{"inflight": 0, "max_lora": 2}, {"inflight": 2, "max_lora": 2, "lora_waiting": frozenset({"sql"})}], 1),
    # ... but not past it: a hot adapter does not pile onto one worker (session-affinity: no bound).
    ([{"inflight": 0, "max_lora": 2}, {"inflight": 20, "max_lora": 2, "lora_running": frozenset({"sql"})}],
     {"least-loaded": 0, "prefix-aware": 0, "session-affinity": 1}),
    # Not loaded anywhere: a worker with a free slot (no eviction) beats an idler full one.
    ([{"inflight": 0, "max_lora": 1, "lora_running": frozenset({"chat"})}, {"inflight": 1, "max_lora": 1}], 1),
    # No free slot anywhere: least-loaded.
    ([{"inflight": 2, "max_lora": 1, "lora_running": frozenset({"chat"})},
      {"inflight": 1, "max_lora": 1, "lora_running": frozenset({"code"})}], 1),
])
def test_lora_affinity_prefers_workers_holding_the_adapter(states, expected):
    workers = pool(*({"parents": {"sql": "m"}, **s} for s in states))
    for name in ("least-loaded", "prefix-aware", "session-affinity"):
        ctx = PolicyContext(kv_index=KVIndex()) if name == "prefix-aware" else PolicyContext()
        want = expected[name] if isinstance(expected, dict) else expected
        assert pick(name, workers, LORA_REQUEST, ctx) == want, name


def test_lora_affinity_picks_a_worker_that_would_load_the_adapter_only_when_none_serves_it():
    serving = {"models": frozenset({"m", "sql"}), "parents": {"sql": "m"}, "max_lora": 2}
    loader = {"models": frozenset({"m"}), "lora_loading": True, "max_lora": 2}
    for name in ("least-loaded", "prefix-aware", "session-affinity"):
        ctx = PolicyContext(kv_index=KVIndex()) if name == "prefix-aware" else PolicyContext()
        assert pick(name, pool({**loader, "inflight": 0}, {**serving, "inflight": 3}), LORA_REQUEST, ctx) == 1, name
    # ... while the load headroom keeps a busy one out, a loader takes the hand-off (least-loaded).
    assert pick("least-loaded", pool({**loader, "inflight": 0}, {**serving, "inflight": 20}), LORA_REQUEST) == 0


def test_lora_affinity_leaves_base_model_requests_alone():
    workers = pool({"inflight": 1, "max_lora": 1, "lora_running": frozenset({"sql"}), "parents": {"sql": "m"}},
                   {"inflight": 0, "max_lora": 1, "lora_running": frozenset({"chat"}), "parents": {"sql": "m"}})
    assert pick("least-loaded", workers) == 1


def test_lora_requests_info_is_read_as_vllm_writes_it():
    from pdserve.router.prober import parse_lora
    text = ('# TYPE vllm:lora_requests_info gauge\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9\n'
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9\n')
    assert parse_lora(text) == {"lora_running": frozenset({"a", "b"}), "lora_waiting": frozenset({"c"}), "max_lora": 2}
    assert parse_lora("vllm:num_requests_waiting 0.0\n") is None
