"""bench/handoff_report.py on hand-made runs: per-request first gaps, the stall model (against a
chunk-by-chunk simulation of one link), the fitted fixed costs, issue 24's targets, the report."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.bench import handoff_report as hr

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "dtype": "bfloat16"}


@pytest.mark.parametrize("config,expected", [
    (LLAMA_8B, 32 * 2 * 8 * 128 * 2),
    ({**LLAMA_8B, "head_dim": 64, "dtype": None, "torch_dtype": "float32"}, 32 * 2 * 8 * 64 * 4),
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 2 * 2 * 4 * 16 * 2),  # MHA
])
def test_kv_bytes_per_token(config, expected):
    assert hr.kv_bytes_per_token(config) == expected


def simulated_stall(nbytes: float, gbps: float, prefill_ms: float, n: int) -> float:
    """Chunk k (equal sizes) is ready at k*P/n and crosses one link after the one before it."""
    link_free = 0.0
    for k in range(1, n + 1):
        link_free = max(link_free, k * prefill_ms / n) + nbytes / n / (gbps * 1e6)
    return link_free - prefill_ms


def test_overlap_model_matches_a_chunk_by_chunk_simulation():
    rng = random.Random(0)
    for _ in range(500):
        nbytes, gbps, prefill, n = (rng.uniform(1e6, 3e9), rng.choice((1, 2, 10, 25, 50, 200)), rng.uniform(1, 900),
                                    rng.randint(1, 40))
        assert hr.stall_on_ms(nbytes, gbps, prefill, n, 0.0) == pytest.approx(simulated_stall(nbytes, gbps, prefill, n))


@pytest.mark.parametrize("gbps,prefill,n,fixed,expected", [
    (25, 80.0, 6, 0.0, 393.216 / 25 / 6),  # fast link: only the last chunk is left
    (2, 80.0, 6, 0.0, 393.216 / 2 - 80 * 5 / 6),  # slow link: the backlog the prefill could not hide
    (2, 80.0, 1, 4.0, 393.216 / 2 + 4),  # one chunk: no overlap at all
])
def test_overlap_model_cases(gbps, prefill, n, fixed, expected):
    assert hr.stall_on_ms(393.216e6, gbps, prefill, n, fixed) == pytest.approx(expected)
    assert hr.stall_off_ms(393.216e6, gbps, fixed) == pytest.approx(393.216 / gbps + fixed)


def record(stack, kind, *, rate=None, prompt_len=3000, gaps=(0.030, 0.006, 0.006), ttft=0.09, n=10, good=None,
           p_ttft_s=0.08, kv_s=0.015, kv_bytes=393e6, tail_s=None):
    transport = None if stack == "agg" else stack.split("-")[0]
    metrics, roles = {}, {"http://r": "router", "http://d": "decode-0"}
    if transport:
        roles["http://p"] = "prefill-0"
        metrics = {
            "http://p": {
                "vllm:time_to_first_token_seconds_sum": n * p_ttft_s,
                "vllm:time_to_first_token_seconds_count": n,
            },
            "http://d": {
                f'pdserve_kv_transfer_bytes_total{{direction="recv",transport="{transport}"}}': n * kv_bytes,
                f'pdserve_kv_transfer_seconds_sum{{direction="recv",transport="{transport}"}}': n * kv_s,
                f'pdserve_kv_transfer_seconds_count{{direction="recv",transport="{transport}"}}': n,
            },
        }
        if tail_s is not None:  # a streamed pull's tail after the prefill's end
            labels = f'{{direction="recv",transport="{transport}"}}'
            metrics["http://d"] |= {f"pdserve_kv_pull_tail_seconds_sum{labels}": n * tail_s,
                                    f"pdserve_kv_pull_tail_seconds_count{labels}": n}
    stats = {"mean": 0.0, "std": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {
        "stack": stack,
        "transport": transport,
        "overlap": None if stack == "agg" else stack.endswith("-on"),
        "kind": kind,
        "request_rate": rate,
        "input_len": prompt_len,
        "output_len": 200,
        "roles": roles,
        "server_metrics": metrics,
        "requests": [{"error": None, "ttft": ttft, "itls": list(gaps)}] * n,
        "summary": {
            "num_requests": n,
            "completed": n,
            "failed": 0,
            "errors": {},
            "request_throughput": 1.0,
            "output_throughput": 200.0,
            "request_goodput": 1.0,
            "good_requests": n if good is None else good,
            "ttft_s": stats,
            "itl_s": stats,
            "send_lag_s": stats,
        },
    }


def test_row_splits_the_first_gap_from_the_steady_gaps():
    r = hr.row(record("nixl-off", "load", rate=1, gaps=(0.030, 0.005, 0.007, 0.006)))
    assert r["first_gap_p50_ms"] == pytest.approx(30) and r["first_gap_max_ms"] == pytest.approx(30)
    assert r["steady_itl_p50_ms"] == pytest.approx(6)
    assert r["kv_ms"] == pytest.approx(15) and r["kv_gbps"] == pytest.approx(393e6 / 0.015 / 1e9)
    assert r["p_ttft_ms"] == pytest.approx(80) and r["good"] == 10
    assert "kv_ms" not in hr.row(record("agg", "load", rate=1))
    assert r["kv_tail_ms"] is None  # no streamed pull, no tail
    assert hr.row(record("nixl-on", "load", rate=1, tail_s=0.004))["kv_tail_ms"] == pytest.approx(4)


def sweep_rows(stack, first_gap_ms, kv_ms):
    per_token = hr.kv_bytes_per_token(LLAMA_8B)
    return [hr.row(record(stack, "sweep", prompt_len=L, gaps=(first_gap_ms(L) / 1e3, 0.006, 0.006),
                          p_ttft_s=L * 27e-6, kv_s=kv_ms(L) / 1e3, kv_bytes=L * per_token))
            for L in (1024, 3000, 8192, 16384)]


def test_prediction_fits_the_fixed_costs_and_checks_the_model():
    per_token = hr.kv_bytes_per_token(LLAMA_8B)
    kv_ms = lambda L: L * per_token / 25e6  # a 25 GB/s link
    rows = sweep_rows("nixl-off", lambda L: kv_ms(L) + 20, kv_ms)
    rows += sweep_rows("nixl-on", lambda L: hr.stall_on_ms(L * per_token, 25, L * 27e-3, -(-L // 512), 7.0,
                                                           hr.LAYER_GROUPS), kv_ms)
    pred = hr.prediction(rows, per_token, 512)
    assert pred["fixed_off_ms"] == pytest.approx(20) and pred["fixed_on_ms"] == pytest.approx(7)
    t3000 = next(t for t in pred["table"] if t["prompt_len"] == 3000)
    assert t3000["chunks"] == 6 and t3000["kv_mb"] == pytest.approx(3000 * per_token / 1e6)
    assert t3000["off_ms"]["2"] == pytest.approx(3000 * per_token / 2e6 + 20)
    # A 50 GB/s link is idle between chunks: only the last chunk's last layer group is left.
    assert t3000["on_ms"]["50"] == pytest.approx(3000 * per_token / 50e6 / 6 / hr.LAYER_GROUPS + 7)
    assert all(c["predicted_ms"] == pytest.approx(c["measured_ms"]) for c in pred["checks"])
    assert hr.prediction([], per_token, 512) == {}


def simulated_split_stall(nbytes: float, gbps: float, prefill_ms: float, chunks: list[int]) -> float:
    """Chunk by chunk, each ready when its share of the prefill's time (by tokens) has passed."""
    total, done, link_free = sum(chunks), 0, 0.0
    for c in chunks:
        done += c
        link_free = max(link_free, done / total * prefill_ms) + nbytes * c / total / (gbps * 1e6)
    return link_free - prefill_ms


def test_the_model_of_unequal_chunks_agrees_with_its_closed_form_and_a_simulation():
    rng = random.Random(1)
    for _ in range(300):
        nbytes, gbps, prefill, n = (rng.uniform(1e6, 3e9), rng.choice((1, 2, 10, 25, 50)), rng.uniform(1, 900),
                                    rng.randint(1, 30))
        assert hr.stall_on_ms(nbytes, gbps, prefill, [7] * n, 0.0) == pytest.approx(
            hr.stall_on_ms(nbytes, gbps, prefill, n, 0.0)
        )
        chunks = [rng.randint(1, 9000) for _ in range(rng.randint(1, 6))]
        assert hr.stall_on_ms(nbytes, gbps, prefill, chunks, 2.0) == pytest.approx(
            simulated_split_stall(nbytes, gbps, prefill, chunks) + 2.0)


@pytest.mark.parametrize("tokens,split,expected", [
    (3000, "tail", [2488, 512]), (16384, "tail", [8704, 7168, 512]), (300, "tail", [300]),
    (3000, "taper", [1464, 1024, 512]), (16384, "taper", [8704, 4096, 2048, 1024, 512]),
    (3000, "even", 6),
])
def test_prompt_chunks_are_the_schedulers_cut(tokens, split, expected):
    assert hr.prompt_chunks(tokens, 512, split, 8704) == expected


def test_prediction_checks_each_stack_with_its_own_split():
    """--kv-stream-split auto: the NIXL stack is modelled with tail, the TCP one with taper (a
    TCP target read against equal chunks would be wrong for both)."""
    per_token = hr.kv_bytes_per_token(LLAMA_8B)
    kv_nixl, kv_tcp = (lambda L: L * per_token / 25e6), (lambda L: L * per_token / 2e6)
    rows = sweep_rows("nixl-off", lambda L: kv_nixl(L) + 20, kv_nixl) + sweep_rows("nixl-on", lambda L: 8.0, kv_nixl)
    rows += sweep_rows("tcp-off", lambda L: kv_tcp(L) + 20, kv_tcp) + sweep_rows("tcp-on", lambda L: 30.0, kv_tcp)
    pred = hr.prediction(rows, per_token, 512, "auto", 8704)
    assert pred["split"] == "tail"
    t3000 = next(t for t in pred["table"] if t["prompt_len"] == 3000)
    assert t3000["chunks"] == 2
    check = next(c for c in pred["checks"] if c["stack"] == "tcp-on" and c["prompt_len"] == 3000)
    assert check["unhidden_ms"] == pytest.approx(hr.stall_on_ms(3000 * per_token, 2, 3000 * 27e-3, [1464, 1024, 512], 0,
                                                                hr.LAYER_GROUPS))


def test_a_layered_last_chunk_leaves_only_its_last_group_after_the_prefill():
    """A link exactly as fast as the prefill makes KV: whole chunks leave the last chunk's bytes
    (a chunk's time) after the prefill; layer groups leave only the last group's."""
    nbytes, gbps = 400e6, 4.0
    link_ms = nbytes / (gbps * 1e6)
    assert hr.stall_on_ms(nbytes, gbps, link_ms, 1, 0.0) == pytest.approx(link_ms)
    assert hr.stall_on_ms(nbytes, gbps, link_ms, 1, 0.0, groups=8) == pytest.approx(link_ms / 8)
    assert hr.stall_on_ms(nbytes, gbps, 2 * link_ms, 4, 0.0, groups=8) == pytest.approx(link_ms / 32)  # link idle
    assert hr.stall_on_ms(nbytes, gbps, link_ms, 4, 0.0, groups=8) == pytest.approx(link_ms / 4)  # link busy: no help


def targets_for(rows):
    return {t["target"].split(" at ")[0].split(" (")[0]: (t["off"][1], t["on"][1])
            for t in hr.targets(rows, hr.prediction(rows, hr.kv_bytes_per_token(LLAMA_8B), 512), (1, 6))}


def test_targets_before_and_after():
    rows = [hr.row(record("agg", "load", rate=1, ttft=0.090, gaps=(0.0055, 0.0057))),
            hr.row(record("nixl-off", "load", rate=1, ttft=0.089, gaps=(0.024, 0.0056))),
            hr.row(record("nixl-on", "load", rate=1, ttft=0.093, gaps=(0.0070, 0.0056))),
            hr.row(record("nixl-off", "load", rate=6, gaps=(0.035, 0.008), good=4)),
            hr.row(record("nixl-on", "load", rate=6, gaps=(0.010, 0.008), good=10))]
    per_token = hr.kv_bytes_per_token(LLAMA_8B)
    kv_nixl, kv_tcp = (lambda L: L * per_token / 25e6), (lambda L: L * per_token / 2e6)
    rows += sweep_rows("nixl-off", lambda L: kv_nixl(L) + 20, kv_nixl)
    rows += sweep_rows("nixl-on", lambda L: 8.0, kv_nixl)
    rows += sweep_rows("tcp-off", lambda L: kv_tcp(L) + 20, kv_tcp)
    rows += sweep_rows("tcp-on", lambda L: hr.stall_on_ms(L * per_token, 2, L * 27e-3, -(-L // 512), 8.0), kv_tcp)
    got = targets_for(rows)
    assert got["first gap p50 <= 1.5x steady ITL p50"] == ("missed", "met")
    assert got["first gap p99 <= 25 ms"] == ("missed", "met")
    assert got["requests with TTFT <= 2 s and every gap <= 25 ms >= 90%"] == ("missed", "met")
    assert got["P/D TTFT p50 <= aggregated + 5 ms"] == ("met", "met")
    assert got["first gap flat over prompt lengths"] == ("missed", "met")
    assert got["TCP: stall"] == ("missed", "met")


def test_targets_not_measured_without_rows():
    assert all(t["off"] == ("not measured", "n/a") and t["on"] == ("not measured", "n/a")
               for t in hr.targets([], {}, (1, 6)))


def test_render_writes_the_report_and_the_figure(tmp_path):
    per_token = hr.kv_bytes_per_token(LLAMA_8B)
    kv = lambda L: L * per_token / 25e6
    rows = [hr.row(record("agg", "load", rate=1)), hr.row(record("nixl-off", "load", rate=1)),
            hr.row(record("nixl-on", "load", rate=1, tail_s=0.0375))]
    rows += sweep_rows("nixl-off", lambda L: kv(L) + 20, kv) + sweep_rows("nixl-on", lambda L: 8.0, kv)
    summary = {
        "environment": "test",
        "commit": "abc",
        "flags_note": "",
        "rows": rows,
        "stages": [["agg start", 20.0]],
        "skipped": ["tcp-on (budget)"],
        "config": {
            "model": "m",
            "chunk_tokens": 512,
            "seconds": 20,
            "input_len": 3000,
            "output_len": 200,
            "rates": [1, 6],
            "sweep_requests": 5,
            "sweep_output_len": 32,
            "kv_bytes_per_token": per_token,
        },
    }
    paths = hr.render(summary, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "| 15.0 (26.2) | 37.5 | 80.0 |" in text  # the streamed row's KV pull, its tail, the prefill's TTFT
    for part in ("| 1 | aggregated |", "| 16384 | P/D nixl, overlap on |", "Predicted stall", "| 2 GB/s off / on",
                 "Issue 24's targets", "| agg start | 20 |", "tcp-on (budget)"):
        assert part in text
    assert json.loads((tmp_path / "summary.json").read_text())["targets"]
    if hr.figure(summary, tmp_path / "again.png") is not None:  # matplotlib is a dev extra
        assert (tmp_path / "first_gap_vs_prompt.png").stat().st_size > 1000 and len(paths) == 3
