"""Tables, the P/D TTFT split and the issue's three targets, from `bench/disagg.py`'s run records.

Definitions (stated again in the report):
- a point meets the SLO when no request failed, TTFT p99 <= 2 s and ITL p99 <= 25 ms; a setup's
  goodput is the highest swept rate that meets it (DistServe's rate-level goodput);
- a setup keeps up at a rate when no request failed and TTFT p99 <= 2 s (queues do not grow);
- the P/D split comes from the servers' /metrics deltas over the run: the prefill worker's own
  TTFT (arrival there -> first token: queue + prefill), the decode worker's KV pulls, the router's
  prefill call and handoff (prefill answer -> decode worker's first byte: KV pull + admission).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.bench import server_metrics as sm


def _sum_prefix(m: dict, url: str, prefix: str) -> float:
    return sum(v for k, v in m.get(url, {}).items() if k.startswith(prefix))


def _role(run: dict, role: str) -> str | None:
    return next((u for u, n in run["roles"].items() if n.startswith(role)), None)


def point(run: dict) -> dict:
    s = run["summary"]
    row = {"setup": run["setup"], "workload": run["workload"], "rate": run["request_rate"],
           "sent": s["num_requests"], "failed": s["failed"], "errors": s["errors"],
           "req_s": s["request_throughput"], "out_tok_s": s["output_throughput"],
           "ttft_p50_ms": s["ttft_s"]["p50"] * 1e3, "ttft_p99_ms": s["ttft_s"]["p99"] * 1e3,
           "ttft_mean_ms": s["ttft_s"]["mean"] * 1e3,
           "itl_p50_ms": s["itl_s"]["p50"] * 1e3, "itl_p99_ms": s["itl_s"]["p99"] * 1e3,
           "request_goodput": s["request_goodput"], "send_lag_p99_ms": s["send_lag_s"]["p99"] * 1e3}
    row["keeps_up"] = s["failed"] == 0 and s["completed"] > 0 and row["ttft_p99_ms"] <= 2000
    row["meets_slo"] = row["keeps_up"] and row["itl_p99_ms"] <= 25
    if run["setup"] == "pd":
        m, router, pre, dec = run["server_metrics"], _role(run, "router"), _role(run, "prefill"), _role(run, "decode")
        kv_bytes = _sum_prefix(m, dec, 'pdserve_kv_transfer_bytes_total{direction="recv"')
        kv_n = _sum_prefix(m, dec, 'pdserve_kv_transfer_seconds_count{direction="recv"')
        kv_s = _sum_prefix(m, dec, 'pdserve_kv_transfer_seconds_sum{direction="recv"')
        firsts = [q["itls"][0] for q in run["requests"] if q["error"] is None and q["itls"]]
        tail_n = _sum_prefix(m, dec, 'pdserve_kv_pull_tail_seconds_count{direction="recv"')  # streamed pulls only
        tail_s = _sum_prefix(m, dec, 'pdserve_kv_pull_tail_seconds_sum{direction="recv"')
        row.update({
            "p_ttft_ms": (sm.mean(m, "vllm:time_to_first_token_seconds", [pre]) or 0) * 1e3,
            "router_prefill_ms": (sm.mean(m, "pdserve_router_prefill_seconds", [router]) or 0) * 1e3,
            "handoff_ms": (sm.mean(m, "pdserve_router_handoff_seconds", [router]) or 0) * 1e3,
            "kv_pulls": kv_n, "kv_mb_per_req": kv_bytes / kv_n / 1e6 if kv_n else 0.0,
            "kv_ms": kv_s / kv_n * 1e3 if kv_n else 0.0, "kv_gbps": kv_bytes / kv_s / 1e9 if kv_s else 0.0,
            "kv_tail_ms": tail_s / tail_n * 1e3 if tail_n else None,
            "kv_failures": _sum_prefix(m, dec, "pdserve_kv_transfer_failures_total"),
            "first_gap_ms": sum(firsts) / len(firsts) * 1e3 if firsts else 0.0,
        })
    return row


def _goodput(rows: list[dict]) -> float:
    return max((r["rate"] for r in rows if r["meets_slo"]), default=0.0)


def targets(rows: list[dict]) -> list[tuple[str, str, str]]:
    by = lambda setup, w: sorted(
        (r for r in rows if r["setup"] == setup and r["workload"] == w), key=lambda r: r["rate"]
    )
    agg, pd = by("agg", "3000-200"), by("pd", "3000-200")
    out = []
    ga, gp = _goodput(agg), _goodput(pd)
    ratio = f"{gp / ga:.2f}x" if ga else ("inf" if gp else "n/a")
    out.append(("goodput(b) >= 1.5x goodput(a), 3000/200", f"(a) {ga:g} req/s, (b) {gp:g} req/s: {ratio}",
                "met" if (ga and gp >= 1.5 * ga) or (not ga and gp) else "missed"))
    held = [r for r in agg if r["keeps_up"]]
    if held and (twin := next((r for r in pd if r["rate"] == held[-1]["rate"]), None)):
        a = held[-1]
        tput, itl = twin["out_tok_s"] / a["out_tok_s"], twin["itl_p99_ms"] / a["itl_p99_ms"]
        out.append(
            (
                f"at (a)'s highest kept-up rate ({a['rate']:g} req/s): (b) >= 95% of its throughput, ITL p99 <= 0.5x",
                f"throughput {tput:.0%}, ITL p99 {twin['itl_p99_ms']:.1f} vs {a['itl_p99_ms']:.1f} ms ({itl:.2f}x)",
                "met" if tput >= 0.95 and itl <= 0.5 else "missed",
            )
        )
    else:
        out.append(("(b) >= 95% of (a)'s throughput at (a)'s highest kept-up rate, ITL p99 <= 0.5x",
                    "(a) kept up at no swept rate", "not measured"))
    if agg and pd and agg[0]["rate"] == pd[0]["rate"]:
        extra = pd[0]["ttft_p50_ms"] - agg[0]["ttft_p50_ms"]
        out.append((f"extra TTFT at low load ({agg[0]['rate']:g} req/s) <= KV transfer + 2 ms",
                    f"TTFT p50 {pd[0]['ttft_p50_ms']:.1f} vs {agg[0]['ttft_p50_ms']:.1f} ms: +{extra:.1f} ms; "
                    f"KV pull {pd[0]['kv_ms']:.1f} ms", "met" if extra <= pd[0]["kv_ms"] + 2 else "missed"))
    return out


def environment(smoke: bool) -> str:
    if smoke:
        return f"CPU smoke run (tiny model, TCP) · {datetime.date.today()}"
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except OSError:
        gpus = ["?"]
    versions = []
    for pkg in ("torch", "triton", "nixl-cu13", "transformers"):
        try:
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return f"{len(gpus)}x {gpus[0]} · {' · '.join(versions)} · {datetime.date.today()}"


def write(runs: list[dict], out: Path, slo: dict, smoke: bool, plots: bool = False) -> None:
    rows = [point(r) for r in runs]
    lines = [f"{environment(smoke)}", "",
             f"SLO: TTFT p99 <= {slo['ttft']:g} ms and ITL p99 <= {slo['itl']:g} ms. Per-request goodput: "
             f"requests with TTFT <= {slo['ttft']:g} ms and every gap <= {slo['itl']:g} ms, per second.", ""]
    for w in dict.fromkeys(r["workload"] for r in rows):
        lines += [
            f"### {w.replace('-', ' in / ')} out",
            "",
            "| setup | rate | sent | failed | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "per-request goodput | SLO met |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- |",
        ]
        for r in sorted((r for r in rows if r["workload"] == w), key=lambda r: (r["setup"] != "agg", r["rate"])):
            lines.append(f"| {r['setup']} | {r['rate']:g} | {r['sent']} | {r['failed']} | {r['req_s']:.2f} | "
                         f"{r['out_tok_s']:.0f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                         f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['request_goodput']:.2f} | "
                         f"{'yes' if r['meets_slo'] else 'no'} |")
        for setup in ("agg", "pd"):
            lines.append(
                f"\ngoodput ({setup}): {_goodput([r for r in rows if r['workload'] == w and r['setup'] == setup]):g} req/s"  # noqa: E501
            )
        pd = sorted((r for r in rows if r["workload"] == w and r["setup"] == "pd"), key=lambda r: r["rate"])
        if pd:
            low = pd[0]["p_ttft_ms"]
            lines += ["", "P/D TTFT split (means over the run, ms; queue = prefill-worker TTFT minus its value at the "
                      "lowest rate):", "",
                      "| rate | client TTFT | router prefill call | prefill worker TTFT | of which queue (est.) | "
                      "KV MB/req | KV pull ms | KV GB/s | handoff | client first gap |",
                      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for r in pd:
                lines.append(
                    f"| {r['rate']:g} | {r['ttft_mean_ms']:.1f} | {r['router_prefill_ms']:.1f} | "
                    f"{r['p_ttft_ms']:.1f} | {r['p_ttft_ms'] - low:.1f} | {r['kv_mb_per_req']:.1f} | "
                    f"{r['kv_ms']:.2f} | {r['kv_gbps']:.1f} | {r['handoff_ms']:.2f} | {r['first_gap_ms']:.2f} |"
                )
        lines.append("")
    lines += ["### Targets (3000 in / 200 out)", "", "| target | reached | verdict |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in targets(rows)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"environment": environment(smoke), "points": rows}, indent=1))
    if plots and runs:
        from pdserve.bench import plot

        if not plot.available():
            return
        for w in dict.fromkeys(r["workload"] for r in runs):
            tmp = Path(tempfile.mkdtemp())
            for path in plot.plot_runs([r for r in runs if r["workload"] == w], tmp,
                                       f"{w.replace('-', ' in / ')} out: agg (2 workers) vs pd (1P+1D)"):
                shutil.move(path, out / f"{w}_{path.name}")
            shutil.rmtree(tmp, ignore_errors=True)
