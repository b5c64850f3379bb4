"""Rows, the stall model, issue 24's targets, results.md and the figure, from bench/handoff.py's runs.

Definitions (stated again in the report):
- first gap: the client's gap between the first and the second content chunk of a request (one
  token per chunk): in P/D the hand-off stall (first token from P, second from D);
- steady ITL: every later gap, pooled over the point's requests;
- good: a request with TTFT <= 2 s and every gap <= 25 ms (vLLM's per-request goodput);
- P/D split from the servers' /metrics deltas (bench/disagg_report.point): the prefill worker's
  TTFT (queue + prefill), the decode worker's KV pulls (bytes, seconds).
Everything here reads and writes plain dicts, so `--replot` rebuilds the report from summary.json.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from pdserve.bench import disagg_report, server_metrics
from pdserve.worker.kv.connector_scheduler import resolve_split, stream_chunk
from pdserve.worker.kv.layer_clock import LAYER_GROUPS

LINKS_GBPS = (2, 10, 25, 50)
FLAT_MS = 5.0  # "flat": first gap spread over prompt lengths, and the TCP slack of issue 24


def pct(values: list[float], p: float) -> float:
    """numpy.percentile's linear interpolation; nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def row(run: dict) -> dict:
    """One point: a serve run record of bench/handoff.py (keys stack, transport, overlap, kind added)."""
    ok = [q for q in run["requests"] if q["error"] is None]
    firsts = [q["itls"][0] * 1e3 for q in ok if q["itls"]]
    steady = [g * 1e3 for q in ok for g in q["itls"][1:]]
    s = run["summary"]
    r = {"stack": run["stack"], "transport": run["transport"], "overlap": run["overlap"], "kind": run["kind"],
         "rate": run["request_rate"], "prompt_len": run["input_len"], "output_len": run["output_len"],
         "sent": s["num_requests"], "failed": s["failed"], "errors": s["errors"], "good": s.get("good_requests"),
         "ttft_p50_ms": pct([q["ttft"] * 1e3 for q in ok], 50), "ttft_p99_ms": pct([q["ttft"] * 1e3 for q in ok], 99),
         "first_gap_p50_ms": pct(firsts, 50), "first_gap_p99_ms": pct(firsts, 99),
         "first_gap_max_ms": max(firsts, default=math.nan), "steady_itl_p50_ms": pct(steady, 50),
         "itl_p99_ms": pct(firsts + steady, 99), "send_lag_p99_ms": s["send_lag_s"]["p99"] * 1e3}
    if run["transport"]:  # P/D: the split from /metrics
        d = disagg_report.point({**run, "setup": "pd", "workload": ""})
        r.update({k: d[k] for k in ("p_ttft_ms", "router_prefill_ms", "handoff_ms", "kv_pulls", "kv_mb_per_req",
                                    "kv_ms", "kv_gbps", "kv_tail_ms", "kv_failures")})
    elif run.get("server_metrics"):  # aggregated: the workers' own TTFT, so the router's share shows
        workers = [u for u, n in run.get("roles", {}).items() if not n.startswith("router")]
        ttft = server_metrics.mean(run["server_metrics"], "vllm:time_to_first_token_seconds", workers)
        r["p_ttft_ms"] = ttft * 1e3 if ttft is not None else None
    return r


# ---- the stall model -----------------------------------------------------------------------------

def kv_bytes_per_token(config: dict) -> int:
    """layers x 2 (K and V) x kv heads x head dim x element bytes, from a HF config.json."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    elem = 4 if "32" in str(dtype) else 2
    return config["num_hidden_layers"] * 2 * config.get("num_key_value_heads", heads) * head_dim * elem


def stall_off_ms(nbytes: float, gbps: float, fixed_ms: float) -> float:
    """After-prefill hand-off: the whole KV crosses the link once the prefill has ended."""
    return nbytes / (gbps * 1e6) + fixed_ms


def stall_on_ms(nbytes: float, gbps: float, prefill_ms: float, chunks: int | list[int], fixed_ms: float,
                groups: int = 1) -> float:
    """Streamed hand-off, chunk k sent once computed, one link, the prefill's time split over its
    chunks by their tokens. `chunks`: n equal chunks, where the last byte lands at max over k of
    (k*P/n + (n-k+1)*B/(n*bw)), linear in k, so the stall after the prefill ends is max(last chunk
    alone, B/bw - P*(n-1)/n); or the chunks' token counts (the tail and taper splits), simulated.
    `groups`: the last chunk leaves in that many groups of layers, each once its step wrote it
    (TCP layer pieces, NIXL layer READs: worker/kv/layer_clock.py), simulated as that many chunks."""
    link = nbytes / (gbps * 1e6)
    if isinstance(chunks, int) and groups > 1:
        chunks = [1] * chunks
    if isinstance(chunks, int):
        return max(link / chunks, link - prefill_ms * (chunks - 1) / chunks) + fixed_ms
    if groups > 1:
        chunks = list(chunks[:-1]) + [chunks[-1] / groups] * groups
    total, done, link_free = sum(chunks), 0, 0.0
    for c in chunks:
        done += c
        link_free = max(link_free, prefill_ms * done / total) + link * c / total
    return link_free - prefill_ms + fixed_ms


def prompt_chunks(tokens: int, chunk: int, split: str, budget: int | None) -> int | list[int]:
    """How a streamed prefill of `tokens` is cut into steps (the scheduler's own cut: chunk_cap
    under a step budget of `budget` tokens): token counts, or a count of equal chunks for "even"
    (the model's closed form; an earlier report's runs, which name no split, were even)."""
    if split == "even" or not chunk:
        return max(1, math.ceil(tokens / chunk)) if chunk else 1
    out, left = [], tokens
    while left:
        n = stream_chunk(split, min(left, budget or left), left, chunk)
        out.append(n)
        left -= n
    return out


def _sweep(rows: list[dict], stack: str) -> dict[int, dict]:
    return {r["prompt_len"]: r for r in rows if r["kind"] == "sweep" and r["stack"] == stack
            and r["failed"] < r["sent"]}


def prediction(rows: list[dict], per_token: int, chunk: int, split: str = "even", budget: int | None = None) -> dict:
    """Fits the two fixed costs on the NIXL sweep (TCP if NIXL is missing) and predicts the stall
    per prompt length and link; also checks the model at each stack's own measured link. `split`:
    the workers' --kv-stream-split (auto: each transport's own), `budget`: their step budget."""
    off = _sweep(rows, "nixl-off") or _sweep(rows, "tcp-off")
    on_name = "nixl-on" if _sweep(rows, "nixl-on") else "tcp-on"
    on = _sweep(rows, on_name)
    if not off:
        return {}

    def cut(L: int, stack: str = on_name) -> int | list[int]:
        return prompt_chunks(L, chunk, resolve_split(split, stack.split("-")[0]), budget)

    def groups(stack: str = on_name) -> int:  # both transports move the last step's layers as written
        return LAYER_GROUPS

    n_chunks = cut
    prefill = {L: r["p_ttft_ms"] for L, r in off.items()}
    fixed_off = statistics.median(r["first_gap_p50_ms"] - r["kv_ms"] for r in off.values())
    off_bw = {L: r["kv_gbps"] for L, r in off.items()}
    fixed_on = statistics.median(
        r["first_gap_p50_ms"] - stall_on_ms(L * per_token, off_bw[L], prefill[L], n_chunks(L), 0.0, groups())
        for L, r in on.items() if L in off and off_bw[L] > 0) if on else fixed_off
    table = [{"prompt_len": L, "kv_mb": L * per_token / 1e6, "prefill_ms": prefill[L],
              "chunks": c if isinstance(c := n_chunks(L), int) else len(c),
              "off_ms": {str(g): stall_off_ms(L * per_token, g, fixed_off) for g in LINKS_GBPS},
              "on_ms": {str(g): stall_on_ms(L * per_token, g, prefill[L], n_chunks(L), fixed_on, groups())
                        for g in LINKS_GBPS}}
             for L in sorted(off)]
    checks = []
    for stack in ("nixl-off", "nixl-on", "tcp-off", "tcp-on"):
        twin = _sweep(rows, stack.replace("-on", "-off"))  # the link's speed comes from the off run's pulls
        for L, r in sorted(_sweep(rows, stack).items()):
            if L not in twin or not twin[L]["kv_gbps"] or L not in prefill:
                continue
            bw = twin[L]["kv_gbps"]
            pred = (stall_on_ms(L * per_token, bw, prefill[L], cut(L, stack), fixed_on, groups(stack))
                    if stack.endswith("-on")
                    else stall_off_ms(L * per_token, bw, fixed_off))
            checks.append(
                {
                    "stack": stack,
                    "prompt_len": L,
                    "gbps": bw,
                    "predicted_ms": pred,
                    "measured_ms": r["first_gap_p50_ms"],
                    "stall_ms": r["first_gap_p50_ms"] - r["steady_itl_p50_ms"],
                    "unhidden_ms": stall_on_ms(L * per_token, bw, prefill[L], cut(L, stack), 0.0, groups(stack)),
                }
            )
    return {"per_token_bytes": per_token, "chunk_tokens": chunk, "split": resolve_split(split, on_name.split("-")[0]),
            "fixed_off_ms": fixed_off, "fixed_on_ms": fixed_on,
            "fixed_on_from": on_name if on else "nixl-off (no overlap-on sweep)", "table": table, "checks": checks}


# ---- issue 24's targets ------------------------------------------------------------------------

def _load(rows, stack, rate):
    return next((r for r in rows if r["kind"] == "load" and r["stack"] == stack and r["rate"] == rate), None)


def targets(rows: list[dict], pred: dict, rates: tuple[float, float]) -> list[dict]:
    """Each target for overlap off and on (NIXL unless named): value text and met/missed."""
    low, high = rates
    agg_low = _load(rows, "agg", low)
    out = []

    def add(name, fn):
        cells = {}
        for mode in ("off", "on"):
            try:
                cells[mode] = fn(mode)
            except (TypeError, KeyError, ValueError, statistics.StatisticsError):
                cells[mode] = None
            cells[mode] = cells[mode] or ("not measured", "n/a")
        out.append({"target": name, **cells})

    def gap_vs_itl(mode):
        r = _load(rows, f"nixl-{mode}", low)
        v = r["first_gap_p50_ms"] / r["steady_itl_p50_ms"]
        return f"{r['first_gap_p50_ms']:.1f} vs {r['steady_itl_p50_ms']:.1f} ms ({v:.2f}x)", _verdict(v <= 1.5)

    def gap_p99(mode):
        r = _load(rows, f"nixl-{mode}", high)
        return f"{r['first_gap_p99_ms']:.1f} ms", _verdict(r["first_gap_p99_ms"] <= 25)

    def goodput(mode):
        r = _load(rows, f"nixl-{mode}", high)
        return f"{r['good']}/{r['sent']} ({r['good'] / r['sent']:.0%})", _verdict(r["good"] >= 0.9 * r["sent"])

    def ttft(mode):
        r = _load(rows, f"nixl-{mode}", low)
        d = r["ttft_p50_ms"] - agg_low["ttft_p50_ms"]
        return f"{r['ttft_p50_ms']:.1f} vs {agg_low['ttft_p50_ms']:.1f} ms ({d:+.1f})", _verdict(d <= 5)

    def flat(mode):
        s = _sweep(rows, f"nixl-{mode}")
        if len(s) < 2:
            return None
        gaps = [r["first_gap_p50_ms"] for r in s.values()]
        return f"{min(gaps):.1f}..{max(gaps):.1f} ms", _verdict(max(gaps) - min(gaps) <= FLAT_MS)

    def tcp_slack(mode):
        checks = [c for c in pred.get("checks", []) if c["stack"] == f"tcp-{mode}"]
        if not checks:
            return None
        worst = max(checks, key=lambda c: c["stall_ms"] - c["unhidden_ms"])
        slack = worst["stall_ms"] - worst["unhidden_ms"]
        return (f"worst at {worst['prompt_len']}: {worst['stall_ms']:.1f} vs {worst['unhidden_ms']:.1f} ms "
                f"({slack:+.1f})", _verdict(slack <= FLAT_MS))

    add(f"first gap p50 <= 1.5x steady ITL p50 at {low:g} req/s", gap_vs_itl)
    add(f"first gap p99 <= 25 ms at {high:g} req/s", gap_p99)
    add(f"requests with TTFT <= 2 s and every gap <= 25 ms >= 90% at {high:g} req/s", goodput)
    add(f"P/D TTFT p50 <= aggregated + 5 ms at {low:g} req/s", ttft)
    add(f"first gap flat over prompt lengths (spread <= {FLAT_MS:g} ms)", flat)
    add(f"TCP: stall (first gap - steady ITL, p50) <= transfer that cannot overlap the prefill + {FLAT_MS:g} ms, "
        "every length", tcp_slack)
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


# ---- results.md and the figure -----------------------------------------------------------------

def _f(v: float | None, nd: int = 1) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _g(v: float | None) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def _split_text(pred: dict) -> str:
    split, chunk = pred.get("split", "even"), pred["chunk_tokens"]
    if split == "even":
        return f"chunks of {chunk} tokens, n = ceil(tokens / chunk); in closed form max(bytes / (n bw), bytes / bw - P (n-1)/n)"  # noqa: E501
    return f"the `{split}` split of the {chunk}-token tail, as the scheduler cuts it"


def _setup(r: dict) -> str:
    return "aggregated" if not r["transport"] else f"P/D {r['transport']}, overlap {'on' if r['overlap'] else 'off'}"


def markdown(summary: dict) -> str:
    rows, pred, cfg = summary["rows"], summary.get("prediction") or {}, summary["config"]
    L = [f"# The hand-off stall (issue 24): {summary['environment']}", "",
         f"Commit {summary.get('commit', '?')}. Model: {cfg['model']}; overlap on = router `--pd-handoff streamed` + "
         f"workers `--kv-stream-chunk-tokens {cfg['chunk_tokens']}`, off = `--pd-handoff after-prefill` + "
         f"`--kv-stream-chunk-tokens 0`. Workers sharing a GPU: `pdserve up --gpu-sharing "
         f"{cfg.get('gpu_sharing', 'timeslice')}` (auto: MPS where it starts; up's log says). {summary['flags_note']}",
         "",
         "First gap = the client's gap between token 1 and token 2 (in P/D the hand-off); steady ITL = every later "
         "gap, pooled; good = TTFT <= 2 s and every gap <= 25 ms. KV pull = the decode worker's "
         "`pdserve_kv_transfer_seconds` (mean per request): with overlap on a pull spans the prefill (it waits for "
         "chunks), so its GB/s is not the link's; KV tail = `pdserve_kv_pull_tail_seconds` (mean): what a streamed "
         "pull had left to move once the prefill worker said it was done.", ""]
    load = [r for r in rows if r["kind"] == "load"]
    if load:
        L += [
            f"## {cfg['input_len']} in / {cfg['output_len']} out, Poisson arrivals, {cfg['seconds']:g} s of sending "
            "per point",
            "",
            "| rate | setup | first gap p50 / p99 ms | steady ITL p50 ms | ITL p99 ms | TTFT p50 / p99 ms | good / sent "  # noqa: E501
            "| failed | KV pull ms (GB/s) | KV tail ms | worker TTFT ms (P/D: the prefill worker) |",
            "| ---: | --- | --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |",
        ]
        for r in sorted(load, key=lambda r: (r["rate"], r["transport"] or "", r["overlap"] or False)):
            kv = f"{_f(r.get('kv_ms'))} ({_g(r.get('kv_gbps'))})" if r["transport"] else "–"
            L.append(f"| {r['rate']:g} | {_setup(r)} | {_f(r['first_gap_p50_ms'])} / {_f(r['first_gap_p99_ms'])} | "
                     f"{_f(r['steady_itl_p50_ms'])} | {_f(r['itl_p99_ms'])} | {_f(r['ttft_p50_ms'], 0)} / "
                     f"{_f(r['ttft_p99_ms'], 0)} | {r['good']}/{r['sent']} | {r['failed']} | {kv} | "
                     f"{_f(r.get('kv_tail_ms'))} | {_f(r.get('p_ttft_ms'))} |")
        L.append("")
    sweep = [r for r in rows if r["kind"] == "sweep"]
    if sweep:
        L += [
            f"## Stall after the first token against prompt length ({cfg['sweep_requests']} sequential requests "
            f"per point after 1 warm-up, {cfg['sweep_output_len']} out)",
            "",
            "![first gap](first_gap_vs_prompt.png)",
            "",
            "| prompt | setup | first gap p50 / max ms | steady ITL p50 ms | TTFT p50 ms | prefill-worker TTFT ms "
            "| KV MB/req | KV pull ms | KV GB/s | KV tail ms |",
            "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in sorted(sweep, key=lambda r: (r["prompt_len"], r["transport"], r["overlap"])):
            L.append(f"| {r['prompt_len']} | {_setup(r)} | {_f(r['first_gap_p50_ms'])} / {_f(r['first_gap_max_ms'])} | "
                     f"{_f(r['steady_itl_p50_ms'])} | {_f(r['ttft_p50_ms'])} | {_f(r.get('p_ttft_ms'))} | "
                     f"{_f(r.get('kv_mb_per_req'))} | {_f(r.get('kv_ms'))} | {_g(r.get('kv_gbps'))} | "
                     f"{_f(r.get('kv_tail_ms'))} |")
        L.append("")
    if pred:
        g = " | ".join(f"{b} GB/s off / on" for b in LINKS_GBPS)
        L += [
            "## Predicted stall after the first token, by link (ms)",
            "",
            f"KV bytes = layers x 2 x KV heads x head dim x element bytes x tokens = {pred['per_token_bytes']} B/token. "  # noqa: E501
            f"Without overlap: stall = bytes / bw + c_off. With overlap ({_split_text(pred)}, chunk k sent as soon "
            "as computed over one link, P = the measured prefill, shared by the chunks by their tokens): stall = "
            "when the last chunk's bytes land - P + c_on. c_off = "
            f"{pred['fixed_off_ms']:.1f} ms (median of first gap - KV pull over the off sweep: admission, first decode "
            f"step, relay), c_on = {pred['fixed_on_ms']:.1f} ms (median of first gap - the model's transfer term over "
            f"the {pred['fixed_on_from']} sweep). P = the prefill worker's TTFT at low load, overlap off.",
            "",
            f"| prompt | KV MB | prefill ms | chunks | {g} |",
            "| ---: | ---: | ---: | ---: |" + " --- |" * len(LINKS_GBPS),
        ]
        for t in pred["table"]:
            cells = " | ".join(f"{t['off_ms'][str(b)]:.0f} / {t['on_ms'][str(b)]:.0f}" for b in LINKS_GBPS)
            L.append(f"| {t['prompt_len']} | {t['kv_mb']:.0f} | {t['prefill_ms']:.1f} | {t['chunks']} | {cells} |")
        if pred["checks"]:
            L += [
                "",
                "The model at each run's own link (bw = the off run's measured pull rate; NIXL fits c, TCP tests it):",
                "",
                "| setup | prompt | link GB/s | predicted first gap ms | measured first gap p50 ms | of it over a steady gap "  # noqa: E501
                "| transfer the prefill cannot hide ms |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for c in pred["checks"]:
                L.append(f"| {c['stack']} | {c['prompt_len']} | {_g(c['gbps'])} | {c['predicted_ms']:.1f} | "
                         f"{c['measured_ms']:.1f} | {c['stall_ms']:.1f} | {c['unhidden_ms']:.1f} |")
        L.append("")
    L += [
        "## Issue 24's targets (NIXL unless named)",
        "",
        "| target | overlap off | overlap on |",
        "| --- | --- | --- |",
    ]
    for t in summary["targets"]:
        L.append(f"| {t['target']} | {t['off'][0]}: **{t['off'][1]}** | {t['on'][0]}: **{t['on'][1]}** |")
    L += ["", "## Stages", "", "| stage | seconds |", "| --- | ---: |"]
    L += [f"| {name} | {sec:.0f} |" for name, sec in summary["stages"]]
    if summary["skipped"]:
        L += ["", "Skipped (budget or failure): " + "; ".join(summary["skipped"])]
    return "\n".join(L) + "\n"


def figure(summary: dict, path: Path) -> Path | None:
    """x = prompt tokens, y = first gap p50 (bars to the max), one line per transport x overlap,
    the steady ITL p50 dotted. None without matplotlib (then `--replot` draws it elsewhere)."""
    from pdserve.bench import plot

    sweep = [r for r in summary["rows"] if r["kind"] == "sweep" and not math.isnan(r["first_gap_p50_ms"])]
    if not sweep or not plot.available():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {"nixl": "tab:blue", "tcp": "tab:orange"}
    for stack in dict.fromkeys(r["stack"] for r in sweep):
        pts = sorted((r for r in sweep if r["stack"] == stack), key=lambda r: r["prompt_len"])
        x = [r["prompt_len"] for r in pts]
        y = [r["first_gap_p50_ms"] for r in pts]
        up = [max(0.0, r["first_gap_max_ms"] - r["first_gap_p50_ms"]) for r in pts]
        ax.errorbar(x, y, yerr=[[0] * len(y), up], marker="o", capsize=3, color=colors.get(pts[0]["transport"]),
                    linestyle="-" if pts[0]["overlap"] else "--",
                    label=f"{pts[0]['transport']}, overlap {'on' if pts[0]['overlap'] else 'off'}")
    itl = statistics.median(r["steady_itl_p50_ms"] for r in sweep if not math.isnan(r["steady_itl_p50_ms"]))
    ax.axhline(itl, color="grey", linestyle=":", label=f"steady ITL p50 ({itl:.1f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lens = sorted({r["prompt_len"] for r in sweep})
    ax.set_xticks(lens, [f"{L / 1000:g}k" if L >= 1000 else str(L) for L in lens])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("first gap after token 1, p50 (ms; bar to max)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"stall after the first token: {summary['environment']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(summary: dict, out: Path) -> list[Path]:
    """results.md, summary.json and the figure; the figure's absence is said in results.md. The
    prediction and the targets are derived here from the rows, so `--replot` applies this code."""
    cfg = summary["config"]
    pred = (prediction(summary["rows"], cfg["kv_bytes_per_token"], cfg["chunk_tokens"], cfg.get("stream_split", "even"),
                       cfg.get("max_num_batched_tokens")) if cfg["kv_bytes_per_token"] else {})
    summary = {**summary, "prediction": pred, "targets": targets(summary["rows"], pred, tuple(cfg["rates"]))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    png = figure(summary, out / "first_gap_vs_prompt.png")
    text = markdown(summary)
    if png is None and any(r["kind"] == "sweep" for r in summary["rows"]):
        text += "\n(No figure here: matplotlib is missing. `python -m pdserve.bench.handoff --replot DIR` draws it.)\n"
    (out / "results.md").write_text(text)
    return [out / "results.md", out / "summary.json", *([png] if png else [])]
