"""bench/disagg_report.py on hand-made run records: the P/D split read from /metrics deltas, the
rate-level goodput, and each of the issue's three targets, met and missed."""

from __future__ import annotations

from pdserve.bench import disagg_report

ROUTER, PRE, DEC = "http://r", "http://p", "http://d"


def run(setup: str, rate: float, ttft_p50: float, ttft_p99: float, itl_p99: float, out_tok_s: float,
        failed: int = 0, kv_s: float = 0.0135) -> dict:
    stats = lambda p50, p99: {"mean": p50, "std": 0.0, "p50": p50, "p90": p99, "p99": p99}
    metrics = {}
    roles = {ROUTER: "router", DEC: "decode-0"}
    if setup == "pd":
        roles[PRE] = "prefill-0"
        metrics = {
            ROUTER: {"pdserve_router_prefill_seconds_sum": 0.9, "pdserve_router_prefill_seconds_count": 10,
                     "pdserve_router_handoff_seconds_sum": 0.3, "pdserve_router_handoff_seconds_count": 10},
            PRE: {"vllm:time_to_first_token_seconds_sum": 0.8, "vllm:time_to_first_token_seconds_count": 10},
            DEC: {'pdserve_kv_transfer_bytes_total{direction="recv",transport="nixl"}': 10 * 400e6,
                  'pdserve_kv_transfer_seconds_sum{direction="recv",transport="nixl"}': 10 * kv_s,
                  'pdserve_kv_transfer_seconds_count{direction="recv",transport="nixl"}': 10},
        }
    return {"setup": setup, "workload": "3000-200", "request_rate": rate, "roles": roles, "server_metrics": metrics,
            "requests": [{"error": None, "itls": [0.03, 0.008]}] * 10,
            "summary": {"num_requests": 10, "completed": 10 - failed, "failed": failed, "errors": {},
                        "request_throughput": rate, "output_throughput": out_tok_s, "request_goodput": rate,
                        "ttft_s": stats(ttft_p50, ttft_p99), "itl_s": stats(0.008, itl_p99),
                        "send_lag_s": stats(0.0, 0.001)}}


def verdicts(runs):
    return [v for _, _, v in disagg_report.targets([disagg_report.point(r) for r in runs])]


def test_pd_split_from_metric_deltas():
    p = disagg_report.point(run("pd", 1, 0.09, 0.1, 0.012, 280))
    assert round(p["router_prefill_ms"], 6) == 90 and round(p["p_ttft_ms"], 6) == 80
    assert round(p["handoff_ms"], 6) == 30 and p["kv_pulls"] == 10
    assert round(p["kv_mb_per_req"], 6) == 400 and round(p["kv_ms"], 6) == 13.5
    assert round(p["kv_gbps"], 3) == round(400e6 / 0.0135 / 1e9, 3)
    assert round(p["first_gap_ms"], 6) == 30


def test_all_three_targets_met():
    runs = [run("agg", 1, 0.089, 0.098, 0.011, 281), run("agg", 3, 0.09, 0.15, 0.049, 673),
            run("pd", 1, 0.086, 0.11, 0.013, 279), run("pd", 3, 0.086, 0.17, 0.017, 668)]
    rows = [disagg_report.point(r) for r in runs]
    assert [r["meets_slo"] for r in rows] == [True, False, True, True]
    assert verdicts(runs) == ["met", "met", "met"]


def test_targets_missed():
    runs = [run("agg", 1, 0.080, 0.098, 0.011, 281), run("agg", 3, 0.09, 0.15, 0.02, 673),
            run("pd", 1, 0.100, 0.11, 0.013, 279, kv_s=0.005),  # +20 ms TTFT against a 5 ms pull
            run("pd", 3, 0.2, 2.5, 0.017, 600)]  # TTFT p99 over 2 s: not kept up
    assert verdicts(runs) == ["missed", "missed", "missed"]


def test_failures_break_the_slo_and_a_setup_without_points_has_no_goodput():
    rows = [disagg_report.point(run("agg", 1, 0.08, 0.09, 0.01, 281, failed=1))]
    assert not rows[0]["keeps_up"] and not rows[0]["meets_slo"]
    reached = disagg_report.targets(rows)
    assert reached[0][2] == "missed" and reached[1][2] == "not measured"
