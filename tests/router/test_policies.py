"""Each policy against a table of worker states -> expected pick (pure, no processes)."""

from __future__ import annotations

import pytest

from pdserve.router import policies
from pdserve.protocol.kv_events import block_stored
from pdserve.router.kv_index import KVIndex
from pdserve.router.policies import PolicyContext, RoutingRequest
from pdserve.router.workers import Worker


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
    return workers.index(policy.choose(workers, request or RoutingRequest({})))


def test_registry_lists_builtins_and_rejects_unknown():
    assert {"round-robin", "least-loaded", "prefix-aware", "session-affinity"} <= set(policies.available())
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        policies.create("nope", PolicyContext())


def test_round_robin_cycles_in_url_order():
    workers = pool({}, {}, {})
    policy = policies.create("round-robin", PolicyContext())
    picks = [workers.index(policy.choose(workers, RoutingRequest({}))) for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert workers.index(policy.choose(list(reversed(workers)), RoutingRequest({}))) == 0  # order-independent


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
    assert pick("session-affinity", pool(*states), RoutingRequest({}, session_id=session)) == expected


def test_session_affinity_is_sticky_and_moves_only_lost_sessions():
    workers = pool({}, {}, {}, {})
    policy = policies.create("session-affinity", PolicyContext())
    sessions = [f"user-{i}" for i in range(200)]
    first = {s: policy.choose(workers, RoutingRequest({}, session_id=s)) for s in sessions}
    assert len(set(map(id, first.values()))) == 4  # spreads over every worker
    workers[0].inflight = 50  # load does not break affinity
    assert all(policy.choose(workers, RoutingRequest({}, session_id=s)) is first[s] for s in sessions)
    survivors = workers[1:]
    moved = [s for s in sessions if policy.choose(survivors, RoutingRequest({}, session_id=s)) is not first[s]]
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
    request = RoutingRequest({}, tokenize=lambda body: tokens)
    assert pick("prefix-aware", pool(*states), request, ctx) == expected


def test_prefix_aware_needs_the_index():
    with pytest.raises(ValueError, match="KV event index"):
        policies.create("prefix-aware", PolicyContext())
