"""The planner's decisions (operator/planner.py) from recorded metric snapshots, and the
snapshot reader (operator/planner_metrics.py) from /metrics pages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.operator.planner import Decision, PlannerConfig, PlannerState, RoleBounds, RoleSample, Snapshot, decide
from pdserve.operator.planner_metrics import Scrape, counter_rate, held, quantile, role_sample

TRACES = json.loads((Path(__file__).with_name("planner_snapshots.json")).read_text())


def config(**kw) -> PlannerConfig:
    base = dict(ttft_s=1.0, itl_s=0.05, prefill=RoleBounds(1, 8), decode=RoleBounds(1, 8),
                scale_up_cooldown_s=30, scale_down_window_s=120)
    return PlannerConfig(**{**base, **kw})


def snap(t, p=(1, 1, 0.0, None), d=(1, 1, 0.0, None), held=0, terminating=(0, 0)) -> Snapshot:
    if isinstance(p, RoleSample):
        return Snapshot(t, p, RoleSample(*d), held)
    return Snapshot(t, RoleSample(*p, terminating=terminating[0]), RoleSample(*d, terminating=terminating[1]), held)


def run(cfg: PlannerConfig, trace: list[dict]) -> list[Decision]:
    """Replays a recorded trace: each snapshot's `replicas` are what the previous decision set."""
    state, out, replicas = PlannerState(), [], None
    for row in trace:
        p, d = row["prefill"], row["decode"]
        if replicas is not None:
            p, d = {**p, "replicas": replicas[0]}, {**d, "replicas": replicas[1]}
        s = Snapshot(row["t"], RoleSample(**p), RoleSample(**d), row.get("held", 0))
        decision, state = decide(cfg, state, s)
        out.append(decision)
        replicas = (decision.prefill, decision.decode)
    return out


def test_a_load_step_that_breaks_ttft_adds_prefill_and_not_decode():
    """Recorded: 2 prefill + 2 decode at 3000/200 tokens, then the request rate triples; TTFT p90
    goes from 0.4 s to 3.1 s while ITL stays at 18 ms: prefill grows, decode does not."""
    cfg = config(prefill_capacity_tps=None, decode_capacity_tps=None, ttft_s=1.0, itl_s=0.03)
    decisions = run(cfg, TRACES["load_step"])
    first_breach = 2
    assert [d.prefill for d in decisions[:first_breach]] == [2, 2]
    d = decisions[first_breach]
    assert d.prefill > 2 and d.decode == 2
    assert "TTFT p90 3100 ms" in d.reasons["prefill"] and "(target 1000 ms)" in d.reasons["prefill"]
    # Two workers did 18000 tok/s while missing the target: 9000 per worker is the capacity
    # estimate; at 0.8 utilisation 18000 tok/s needs 3 workers. The next decision (after the
    # cooldown) sees 3 workers still missing at 27000 tok/s, then 4 at 36000 tok/s: 5.
    assert d.capacity["prefill"] == pytest.approx(9000)
    assert d.prefill == 3
    assert decisions[3].prefill == 3  # the third worker is still loading: 3 is still the need
    assert [x.prefill for x in decisions[4:7]] == [4, 5, 5]
    assert decisions[-1].prefill == 5 and decisions[-1].decode == 2


def test_a_saturated_prefill_role_is_sized_from_arrivals_in_one_step():
    """Recorded with the router's arrival counter: the rate triples at t=30; the two saturated
    prefill workers still do 18000 tok/s (their plateau) while 36000 arrive. The planner learns
    9000 per worker from what they did and sizes for what arrives: 5 workers at once, and once
    they are ready TTFT is met again and the count holds."""
    cfg = config(prefill_capacity_tps=None, decode_capacity_tps=None, ttft_s=1.0, itl_s=0.03)
    trace = TRACES["load_step_arrivals"]
    decisions = run(cfg, trace)
    assert [d.prefill for d in decisions] == [2, 2, 5, 5, 5, 5, 5]
    assert all(d.decode == 2 for d in decisions)
    d = decisions[2]
    assert d.capacity["prefill"] == pytest.approx(9000)  # learned from work done, not from arrivals
    assert d.reasons["prefill"].startswith("36000 tok/s arriving at 9000 tok/s per worker x 0.8")
    assert "TTFT p90 3100 ms" in d.reasons["prefill"]
    # Met again with 5 ready: no more replicas, and the reason says the target holds.
    assert "TTFT p90 500 ms (target 1000 ms)" in decisions[-1].reasons["prefill"]
    assert "missed" not in decisions[-1].reasons["prefill"]

    # The same load without the arrival counter (an older router): sized from the plateau, one
    # step short, and left to the breach rule to climb.
    blind = [{**row, "prefill": {k: v for k, v in row["prefill"].items() if k != "arrival_rate"}} for row in trace]
    assert run(cfg, blind)[2].prefill == 3


def test_arrivals_under_work_done_size_for_work_done():
    """A burst's backlog being worked off (or an estimated arrival count that undercounts):
    fewer tokens arrive than the workers do; the planner sizes for the larger."""
    cfg = config(prefill_capacity_tps=1000)
    s = snap(0, p=RoleSample(2, 2, 4000.0, 0.9, arrival_rate=1000.0))
    d, _ = decide(cfg, PlannerState(), s)
    assert d.prefill == 5  # ceil(4000 / 800)
    assert d.reasons["prefill"].startswith("4000 tok/s at 1000 tok/s per worker")


def test_an_arrival_count_in_other_units_is_scaled_by_what_the_role_did_while_keeping_up():
    """A router without a tokenizer estimates prompt tokens, here half of what the workers count;
    selective P/D would do the same (short prompts skip prefill). While prefill keeps up, the
    planner learns the ratio (2); saturated, it sizes from arrivals times that ratio."""
    cfg = config(prefill_capacity_tps=None, decode_capacity_tps=None)
    state = PlannerState()
    calm = RoleSample(2, 2, 12000.0, 0.4, arrival_rate=6000.0)
    for t in (0, 15):
        d, state = decide(cfg, state, snap(t, p=calm))
    assert state.arrival_scale["prefill"] == pytest.approx(2.0) and d.prefill == 2
    saturated = RoleSample(2, 2, 18000.0, 3.1, waiting=40, arrival_rate=18000.0)  # 36000 in the workers' tokens
    d, state = decide(cfg, state, snap(30, p=saturated))
    assert state.arrival_scale["prefill"] == pytest.approx(2.0)  # not learned while behind
    assert d.prefill == 5 and d.reasons["prefill"].startswith("36000 tok/s arriving")


def test_arrivals_alone_count_as_traffic():
    """Requests arriving at the router with nothing done yet (all queued) keep a model awake."""
    cfg = config(prefill=RoleBounds(0, 4), decode=RoleBounds(0, 4), scale_to_zero_after_s=60,
                 prefill_capacity_tps=1000)
    s = Snapshot(100, RoleSample(1, 1, 0.0, None, arrival_rate=500.0), RoleSample(1, 1, 0.0, None))
    assert s.active
    d, _ = decide(cfg, PlannerState(last_active=0, started=0), s)
    assert d.prefill == 1 and "no traffic" not in d.reasons["prefill"]


def test_load_removed_scales_down_one_step_at_a_time_after_the_window():
    cfg = config(prefill_capacity_tps=10000, decode_capacity_tps=1000, scale_down_window_s=120, max_scale_down_step=1)
    decisions = run(cfg, TRACES["load_removed"])
    counts = [d.prefill for d in decisions]
    assert counts[0] == 5
    # Not before the window has passed with a lower need; then one replica per decision.
    assert all(c == 5 for c, row in zip(counts, TRACES["load_removed"]) if row["t"] < 120)
    downs = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    assert downs and all(x == -1 for x in downs)
    assert counts[-1] < 5
    assert any("down" in d.reasons["prefill"] for d in decisions)


def test_scale_down_waits_for_draining_pods():
    cfg = config(prefill_capacity_tps=10000, scale_down_window_s=10)
    state = PlannerState()
    _, state = decide(cfg, state, snap(0, p=(4, 4, 1000.0, 0.2)))
    decision, state = decide(cfg, state, snap(20, p=(4, 4, 1000.0, 0.2), terminating=(1, 0)))
    assert decision.prefill == 4 and "draining" in decision.reasons["prefill"]
    decision, _ = decide(cfg, state, snap(30, p=(4, 4, 1000.0, 0.2)))
    assert decision.prefill == 3


def test_cooldown_holds_a_second_scale_up():
    cfg = config(scale_up_cooldown_s=60)
    state = PlannerState()
    d1, state = decide(cfg, state, snap(0, p=(2, 2, 20000.0, 2.0)))
    assert d1.prefill > 2
    d2, state = decide(cfg, state, snap(10, p=(d1.prefill, d1.prefill, 30000.0, 2.5)))
    assert d2.prefill == d1.prefill and "cooldown" in d2.reasons["prefill"]
    d3, _ = decide(cfg, state, snap(70, p=(d1.prefill, d1.prefill, 30000.0, 2.5)))
    assert d3.prefill > d1.prefill


def test_itl_breach_adds_decode():
    cfg = config(decode_capacity_tps=None)
    d, _ = decide(cfg, PlannerState(), snap(0, p=(2, 2, 5000.0, 0.3), d=(2, 2, 4000.0, 0.09)))
    assert d.decode >= 3 and d.prefill == 2
    assert "ITL p90 90 ms" in d.reasons["decode"]


def test_bounds_ratio_and_gpu_budget():
    cfg = config(prefill_capacity_tps=1000, decode_capacity_tps=1000, prefill=RoleBounds(1, 6),
                 decode=RoleBounds(1, 6, gpus_per_replica=2), gpu_budget=10, ratio_min=0.5, ratio_max=2.0)
    # Needs: prefill ceil(8000/800)=10 -> 6 (max); decode ceil(800/800)=1 -> 3 (P:D <= 2); budget
    # 10 GPUs: 6 + 3*2 = 12 -> take from the role left least loaded.
    d, _ = decide(cfg, PlannerState(), snap(0, p=(1, 1, 8000.0, 0.9), d=(1, 1, 800.0, 0.04)))
    assert d.prefill * 1 + d.decode * 2 <= 10
    assert d.prefill <= 2.0 * d.decode + 1e-9 or d.prefill == cfg.prefill.min_replicas
    assert "P:D <= 2" in d.reasons["decode"] and "GPU budget (10)" in d.reasons["prefill"] + d.reasons["decode"]
    assert d.prefill <= 6


def test_scale_from_zero_and_to_zero():
    cfg = config(prefill=RoleBounds(0, 4), decode=RoleBounds(0, 4), scale_to_zero_after_s=300, scale_down_window_s=60)
    state = PlannerState()
    idle = snap(0, p=(0, 0, 0.0, None), d=(0, 0, 0.0, None))
    d, state = decide(cfg, state, idle)
    assert (d.prefill, d.decode) == (0, 0)
    d, state = decide(cfg, state, snap(5, p=(0, 0, 0.0, None), d=(0, 0, 0.0, None), held=3))
    assert d.decode == 1 and "held" in d.reasons["decode"]
    # Serving, then quiet: nothing goes before scale_to_zero_after_s of silence.
    d, state = decide(cfg, state, snap(100, p=(0, 0, 0.0, None), d=(1, 1, 50.0, 0.01)))
    assert d.decode == 1
    d, state = decide(cfg, state, snap(200, p=(0, 0, 0.0, None), d=(1, 1, 0.0, None)))
    assert d.decode == 1
    d, state = decide(cfg, state, snap(401, p=(0, 0, 0.0, None), d=(1, 1, 0.0, None)))
    assert d.decode == 0 and "no traffic" in d.reasons["decode"]


def test_config_is_validated():
    with pytest.raises(ValueError, match="percentile"):
        config(percentile=1.5)
    with pytest.raises(ValueError, match="gpuBudget"):
        config(gpu_budget=1, prefill=RoleBounds(1, 2), decode=RoleBounds(1, 2))
    with pytest.raises(ValueError, match="minReplicas"):
        RoleBounds(3, 2)


# ---- the snapshot reader ----------------------------------------------------------------------

PAGE = """# HELP vllm:prompt_tokens_total Prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{model_name="m"}} {prompt}
# HELP vllm:generation_tokens_total Generated tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{model_name="m"}} {gen}
# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} {waiting}
# HELP vllm:inter_token_latency_seconds ITL.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{le="0.01",model_name="m"}} {b1}
vllm:inter_token_latency_seconds_bucket{{le="0.05",model_name="m"}} {b2}
vllm:inter_token_latency_seconds_bucket{{le="+Inf",model_name="m"}} {b3}
vllm:inter_token_latency_seconds_count{{model_name="m"}} {b3}
vllm:inter_token_latency_seconds_sum{{model_name="m"}} 1.0
"""
ROUTER = """# TYPE pdserve_router_requests_waiting_for_workers gauge
pdserve_router_requests_waiting_for_workers 2.0
"""


def page(prompt=0, gen=0, waiting=0, b=(0, 0, 0)):
    return PAGE.format(prompt=prompt, gen=gen, waiting=waiting, b1=b[0], b2=b[1], b3=b[2])


def test_rates_and_quantiles_between_two_scrapes():
    before = Scrape().add(page(1000, 100, b=(10, 10, 10))).add(page(500, 50, b=(0, 0, 0)))
    after = Scrape().add(page(3000, 300, 1, b=(10, 60, 110))).add(page(500, 250, 2, b=(0, 0, 0)))
    assert counter_rate(before, after, "vllm:prompt_tokens", 10) == pytest.approx(200)
    assert counter_rate(before, after, "vllm:generation_tokens", 10) == pytest.approx(40)
    # 100 new observations: 0 under 10 ms, 50 in 10..50 ms, 50 above: p50 is 50 ms, p40 at 4/5 of the bucket
    assert quantile(before, after, "vllm:inter_token_latency_seconds", 0.5) == pytest.approx(0.05)
    assert quantile(before, after, "vllm:inter_token_latency_seconds", 0.4) == pytest.approx(0.042)
    assert quantile(before, after, "vllm:inter_token_latency_seconds", 0.9) == pytest.approx(0.05)  # +Inf bucket
    assert quantile(after, after, "vllm:inter_token_latency_seconds", 0.5) is None  # nothing new
    s = role_sample("decode", before, after, None, Scrape(), 10, 0.5, replicas=2, ready=2)
    assert (s.token_rate, s.latency_s, s.waiting) == (pytest.approx(40), pytest.approx(0.05), 3)
    assert held(Scrape().add(ROUTER)) == 2


# As the router renders them (prometheus_client: a `_total` counter and its `_created` gauge).
ARRIVALS = """# TYPE pdserve_router_arrived_requests_total counter
pdserve_router_arrived_requests_total{{model="m"}} {requests}
# TYPE pdserve_router_arrived_prompt_tokens_total counter
pdserve_router_arrived_prompt_tokens_total{{model="m"}} {tokens}
# TYPE pdserve_router_arrived_prompt_tokens_created gauge
pdserve_router_arrived_prompt_tokens_created{{model="m"}} 1.7e9
"""


def test_prefill_demand_is_read_from_the_routers_arrival_counter():
    before = Scrape().add(page(1000)).add(page(0))
    after = Scrape().add(page(3000)).add(page(0))
    routers_before = Scrape().add(ARRIVALS.format(tokens=1000, requests=1)).add(ARRIVALS.format(tokens=0, requests=0))
    routers_after = Scrape().add(ARRIVALS.format(tokens=4000, requests=4)).add(ARRIVALS.format(tokens=3000, requests=3))
    s = role_sample("prefill", before, after, routers_before, routers_after, 10, 0.9, replicas=2, ready=2)
    assert s.token_rate == pytest.approx(200)  # done by the workers
    assert s.arrival_rate == pytest.approx(600)  # arrived at the two routers together
    assert s.demand() == pytest.approx(600)
    # A router that does not export it (an older one): no arrival rate, sized from work done.
    s = role_sample("prefill", before, after, Scrape().add(ROUTER), Scrape().add(ROUTER), 10, 0.9, replicas=2, ready=2)
    assert s.arrival_rate is None and s.demand() == pytest.approx(200)
    # Decode is sized from the tokens it generates; arrivals are prefill's.
    assert role_sample("decode", before, after, routers_before, routers_after, 10, 0.9, 1, 1).arrival_rate is None


def test_a_restarted_pod_counts_from_zero():
    before = Scrape().add(page(5000))
    after = Scrape().add(page(300))
    assert counter_rate(before, after, "vllm:prompt_tokens", 1) == pytest.approx(300)


def test_the_reader_and_the_router_agree_on_the_arrival_series():
    """The name the planner reads is the one the router exports (its own rendering, no copy)."""
    from pdserve.router.metrics import RouterMetrics

    m = RouterMetrics()
    m.arrived_prompt_tokens.labels("tiny").inc(120)
    before = Scrape().add(m.render().decode())
    m.arrived_prompt_tokens.labels("tiny").inc(300)
    after = Scrape().add(m.render().decode())
    s = role_sample("prefill", None, Scrape(), before, after, 3, 0.9, replicas=1, ready=1)
    assert s.arrival_rate == pytest.approx(100)
