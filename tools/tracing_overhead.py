"""What tracing costs (issue 52's "Measure": <= 2 % at sampling 1.0): throughput and inter-token
latency through the local P/D stack with tracing on against off, in one run on one machine.

    python tools/tracing_overhead.py --out DIR [--model PATH] [--device cpu|cuda] [--pairs 6]
        [--requests 48] [--concurrency 8] [--input-len 128] [--output-len 64] [--worker-args='...']
        [--control] [--together] [--profile] [--budget-s S]

Two `pdserve up` stacks (1 prefill + 1 decode worker and the router each) run side by side on
the same checkpoint: "off" without tracing, "on" with `--otlp-traces-endpoint` on the router and
both workers, `OTEL_TRACES_SAMPLER=parentbased_traceidratio` at 1.0 (every request traced), the
SDK's default batching, exporting over OTLP/HTTP to a real receiver in its own process
(tools/otlp_capture.py: every span is decoded there). The stacks take turns: pair k runs the
same fresh prompts (seed k) through both, each stack first in turn, so a drift in the machine's
load lands on both sides. --control adds a third stack without tracing ("off2"): off2/off is the
ratio's noise floor in the same run (two identical stacks are not identical on a busy machine).
--together runs a pair's stacks at the same time instead (the same prompts into each at once,
each stack's CPU counted to its own last answer): on a shared machine whose load moves within
seconds, the stacks then meet the same load, which one-after-another cannot promise.
Each run is a closed loop of --requests streamed completions at --concurrency (bench/serve.py's
client: ignore_eos, exact prompt and output lengths); between runs nothing is sent. Per run:
output tokens/s, ITL mean, TTFT p50, and the CPU seconds the stack's three processes used per
request (/proc, all threads). Per pair the ratios on/off; the report gives their median and
spread. --profile: then one more run through the traced stack under py-spy, and tracing code's
share of each process's samples (the cost without the wall-clock noise of a shared machine).

Afterwards: the spans the receiver got against the traced requests (warm-up included: did every
request's spans arrive?) and every process's `pdserve_tracing_dropped_spans_total`.

Without --model: bench/disagg.py's tiny random Llama and word tokenizer (a step takes about a
millisecond, so the servers' own Python, where the tracing calls are, is most of the cost: the
worst case for the ratio). --model with a real checkpoint (e.g. the default SmolLM2's folder)
measures a model whose steps dominate. tools/gpu/tracing.sh runs this on a GPU with an
8B-shaped --load-format dummy model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from otlp_capture import ReceiverProcess
from pdserve.bench import dataset, serve, serve_metrics
from pdserve.bench.disagg import UpStack, make_checkpoint, scratch_dir

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its reaped children (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLK_TCK  # utime stime cutime cstime


def stack_pids(stack: UpStack) -> dict[str, int]:
    text = stack.out.read_text(errors="replace")
    return {name: int(pid) for name, pid in re.findall(r"started (\S+)\s+pid (\d+)", text)}


def stack_cpu(pids: dict[str, int]) -> float:
    return sum(cpu_seconds(p) for p in pids.values())


def dropped_spans(stack: UpStack) -> dict[str, float]:
    """pdserve_tracing_dropped_spans_total per process and reason (absent: 0)."""
    out = {}
    for name, url in stack.children.items():
        text = httpx.get(url + "/metrics", timeout=10).text
        for reason, value in re.findall(r'pdserve_tracing_dropped_spans_total\{reason="([^"]+)"\} (\S+)', text):
            out[f"{name}:{reason}"] = float(value)
    return out


def one_run(stack: UpStack, pids: dict[str, int], specs, args) -> dict:
    return asyncio.run(load_run(stack, pids, specs, args))


def together(stacks: dict[str, UpStack], pids: dict[str, dict[str, int]], specs, args) -> dict[str, dict]:
    """--together: the same requests through every stack at the same time, each stack's CPU
    counted until its own last answer. A busy machine's load then lands on all of them alike."""
    async def all_of_them():
        return await asyncio.gather(*(load_run(stacks[n], pids[n], specs, args) for n in stacks))
    return dict(zip(stacks, asyncio.run(all_of_them())))


async def load_run(stack: UpStack, pids: dict[str, int], specs, args) -> dict:
    cfg = serve.LoadConfig(base_url=stack.children["router"], model="llama", concurrency=args.concurrency,
                           progress=False, request_timeout_s=300)
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    results, duration = await serve.run_load(cfg, specs)
    each = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    cpu = sum(each.values())
    s = serve_metrics.summarize(results, duration, {})
    return {"completed": s["completed"], "failed": s["failed"], "errors": s["errors"],
            "duration_s": duration, "output_tok_s": s["output_throughput"],
            "itl_mean_ms": s["itl_s"]["mean"] * 1e3, "itl_p50_ms": s["itl_s"]["p50"] * 1e3,
            "itl_p99_ms": s["itl_s"]["p99"] * 1e3, "ttft_p50_ms": s["ttft_s"]["p50"] * 1e3,
            "cpu_ms_per_req": cpu / max(s["completed"], 1) * 1e3,
            "cpu_ms_per_req_by_process": {n: c / max(s["completed"], 1) * 1e3 for n, c in each.items()}}


COST_SERVICE = "pdserve-tracing-cost"  # span_cost's spans: not the stacks', so not counted as theirs
TRACING_FRAMES = ("opentelemetry", "protocol/tracing.py")


def py_spy() -> str | None:
    return shutil.which("py-spy") or next((str(p) for p in [Path(sys.executable).with_name("py-spy")] if p.exists()),
                                          None)


def profile_run(stack: UpStack, pids: dict[str, int], specs, args, folder: Path) -> dict:
    """One more run through the traced stack with py-spy sampling its three processes (100 Hz):
    per process, the share of the sampled stacks inside tracing code (the OpenTelemetry SDK and
    exporter, protocol/tracing.py), its export thread included."""
    spy = py_spy()
    files = {name: folder / f"py-spy-{name}.txt" for name in pids}
    procs = [subprocess.Popen([spy, "record", "-r", "100", "-f", "raw", "-o", str(files[name]),
                               "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in pids.items()]
    time.sleep(2)  # attached before the first request
    run = one_run(stack, pids, specs, args)
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        proc.wait(60)
    out = {"run": run}
    for name, f in files.items():
        total = traced = 0
        for line in f.read_text().splitlines():
            frames, _, n = line.rpartition(" ")
            total += int(n)
            traced += int(n) if any(t in frames for t in TRACING_FRAMES) else 0
        out[name] = {"samples": total, "tracing_samples": traced}
    return out


def span_cost(endpoint: str, n: int) -> float:
    """CPU microseconds one request's tracing takes, measured in this process: the calls the
    router and both workers make for one disaggregated request (protocol/tracing.py, the same 11
    spans, context extraction and injection, attributes), `n` times, with the SDK's batching and
    its OTLP/HTTP export of every span (its thread's CPU included: process time, all threads)."""
    import random

    from pdserve.protocol.tracing import monotonic_to_ns, setup

    t = setup(endpoint, COST_SERVICE)
    attrs = {"gen_ai.request.id": "r", "gen_ai.request.max_tokens": 64, "gen_ai.request.temperature": 0.0,
             "gen_ai.request.top_p": 1.0, "gen_ai.request.n": 1, "gen_ai.usage.prompt_tokens": 128}

    def one() -> None:
        now = time.monotonic()
        # The client's context (random.getrandbits as the SDK's id generator: os.urandom is the
        # harness's cost, not tracing's, and slow on some VMs)
        headers = {"traceparent": f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-01"}
        root = t.start("router completions", t.extract(headers), kind="server",
                       attributes={"gen_ai.request.id": "r", "http.route": "/v1/completions"})
        t.event(root, "route", {"pdserve.route": "disaggregated"})
        calls = {}
        for phase in ("prefill", "decode"):
            calls[phase] = t.start(f"{phase} call", root, kind="client", attributes={"server.address": "w"})
        handoff = None
        for role in ("prefill", "decode"):
            prefill_link = t.link_context(handoff)
            w = t.start(f"worker {role}", t.extract(t.carrier(calls[role])), kind="server",
                        start_ns=monotonic_to_ns(now), links=[prefill_link], attributes=attrs)
            t.record("queue", w, monotonic_to_ns(now), monotonic_to_ns(now), {"gen_ai.request.id": "r"})
            w.set_attribute("gen_ai.latency.time_in_queue", 0.001)
            if role == "prefill":
                handoff = t.carrier(w)
            else:
                t.record("kv transfer", w, monotonic_to_ns(now), monotonic_to_ns(now),
                         {"gen_ai.request.id": "r", "pdserve.kv.bytes": 1 << 20, "pdserve.kv.blocks": 8,
                          "pdserve.kv.transport": "tcp", "pdserve.kv.wait_s": 0.001}, links=[prefill_link])
            t.record("prefill" if role == "prefill" else "first token", w, monotonic_to_ns(now),
                     monotonic_to_ns(now), {"gen_ai.request.id": "r", "gen_ai.usage.cached_tokens": 0})
            w.set_attribute("gen_ai.latency.time_to_first_token", 0.01)
            if role == "decode":
                t.record("decode", w, monotonic_to_ns(now), monotonic_to_ns(now),
                         {"gen_ai.request.id": "r", "gen_ai.usage.completion_tokens": 64,
                          "gen_ai.response.finish_reasons": ["length"]})
            t.end(w, {"gen_ai.response.finish_reasons": ["length"], "gen_ai.usage.completion_tokens": 64,
                      "gen_ai.latency.e2e": 0.1})
        for c in calls.values():
            t.end(c, {"http.response.status_code": 200})
        t.end(root, {"http.response.status_code": 200})

    for _ in range(50):  # imports and first-call costs out of the measurement
        one()
    t._processor.force_flush(10_000)
    c0 = time.process_time()
    for i in range(n):
        one()
        if i % 100 == 99:  # never past the SDK's queue (2048 spans): every span exported, none dropped
            t._processor.force_flush(30_000)
    t._processor.force_flush(30_000)
    cost = (time.process_time() - c0) / n * 1e6
    t.shutdown()
    return cost


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values), "std": statistics.pstdev(values)}


def report(args, runs: list[dict], pairs: list[dict], spans: dict, dropped: dict, machine: str,
           profile: dict | None = None, cost_us: float | None = None) -> str:
    if not pairs:
        return (f"No pair completed: the budget (--budget-s {args.budget_s:g}) was spent before the first pair "
                f"could finish (stack start and warm-up took it). Nothing to compare.\n")
    names = [n for n in ("off", "on", "off2") if n in pairs[0]]
    lines = [f"Workload: {args.requests} streamed completions per run, closed loop at concurrency "
             f"{args.concurrency}{' per stack, the stacks loaded at the same time' if args.together else ''}, "
             f"{args.input_len} prompt / {args.output_len} output tokens (ignore_eos), "
             f"1 prefill + 1 decode worker + router (`pdserve up`, KV over {args.kv_transfer or 'the default'}), "
             f"model {args.model_name}; {machine}. Stacks: {', '.join(names)} (on: tracing at sampling 1.0 to "
             f"a real OTLP/HTTP receiver).", "",
             "| pair | order | " + " | ".join(f"{n} {m}" for m in ("tok/s", "ITL mean ms", "TTFT p50 ms",
                                                                   "CPU ms/req") for n in names) + " |",
             "|---|---|" + "---|" * (4 * len(names))]
    for p in pairs:
        cells = [f"{p[n][key]:{fmt}}" for key, fmt in (("output_tok_s", ".1f"), ("itl_mean_ms", ".2f"),
                                                       ("ttft_p50_ms", ".1f"), ("cpu_ms_per_req", ".1f"))
                 for n in names]
        lines.append(f"| {p['pair']} | {p['order']} | " + " | ".join(cells) + " |")
    lines += ["", "| per pair | median | min | max | mean ± std |", "|---|---|---|---|---|"]
    for other in [n for n in names if n != "off"]:
        for key, label in (("output_tok_s", "throughput"), ("itl_mean_ms", "ITL mean"), ("ttft_p50_ms", "TTFT p50"),
                           ("cpu_ms_per_req", "stack CPU per request")):
            s = spread([p[other][key] / p["off"][key] for p in pairs])
            lines.append(f"| {label} {other}/off | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} | "
                         f"{s['mean']:.3f} ± {s['std']:.3f} |")
    for name in pairs[0]["off"].get("cpu_ms_per_req_by_process", {}):
        s = spread([p["on"]["cpu_ms_per_req_by_process"][name] / p["off"]["cpu_ms_per_req_by_process"][name]
                    for p in pairs])
        lines.append(f"| {name} CPU per request on/off | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} | "
                     f"{s['mean']:.3f} ± {s['std']:.3f} |")
    failed = sum(r["failed"] for r in runs)
    if spans is None:  # written after each pair: what the receiver got is counted at the end
        lines += ["", f"Failed requests: {failed}. Partial: {len(pairs)} pair(s) so far; spans not counted yet."]
        return "\n".join(lines) + "\n"
    lines += ["", f"Failed requests: {failed}. Spans received: {spans['received']} for {spans['traced_requests']} "
              f"traced requests ({spans['per_request']} spans per request in a full trace, expected "
              f"{spans['expected']}). Dropped spans (pdserve_tracing_dropped_spans_total): "
              f"{json.dumps(dropped) if dropped else 'none'}."]
    if cost_us is not None:
        off_cpu = statistics.median(p["off"]["cpu_ms_per_req"] for p in pairs) * 1e3
        lines += ["", f"Tracing's own CPU per request, timed in-process (the router's and both workers' tracing "
                      f"calls for one disaggregated request, 11 spans, batched and exported over OTLP/HTTP to the "
                      f"same receiver, {args.span_cost} requests): **{cost_us:.0f} µs**, against the untraced "
                      f"stack's {off_cpu / 1e3:.1f} ms of CPU per request (median of the off runs): "
                      f"**{cost_us / off_cpu:.2%}**."]
    if profile:
        names = [n for n in profile if n != "run"]
        total = sum(profile[n]["samples"] for n in names)
        traced = sum(profile[n]["tracing_samples"] for n in names)
        lines += ["", f"Profile (py-spy, 100 Hz, one more run of {args.requests} requests through the traced "
                      "stack): share of each process's sampled Python stacks inside tracing code "
                      "(opentelemetry.*, protocol/tracing.py; the SDK's export thread included).", "",
                  "| process | samples | in tracing | share |", "|---|---|---|---|"]
        for n in names + ["all three"]:
            t, tr = ((total, traced) if n == "all three" else
                     (profile[n]["samples"], profile[n]["tracing_samples"]))
            lines.append(f"| {n} | {t} | {tr} | {tr / max(t, 1):.2%} |")
    return "\n".join(lines) + "\n"


def write_results(args, runs, pairs, spans, dropped, machine, profile=None, cost_us=None) -> str:
    """results.md and runs.json in --out (spans None: a partial report, after a pair)."""
    text = report(args, runs, pairs, spans, dropped, machine, profile, cost_us)
    (args.out / "results.md").write_text(text)
    (args.out / "runs.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                                    "runs": runs, "spans": spans, "dropped": dropped,
                                                    "profile": profile, "span_cost_us": cost_us}, indent=1,
                                                   default=str))
    return text


def spans_per_request(rx: ReceiverProcess) -> int:
    """The spans of the first complete trace the receiver holds (router + both workers)."""
    by_trace: dict[str, int] = {}
    for s in rx.spans():
        by_trace[s["trace_id"]] = by_trace.get(s["trace_id"], 0) + 1
    return max(by_trace.values(), default=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", help="checkpoint folder (default: a tiny random Llama made here)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--requests", type=int, default=48, help="requests per run")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8, help="requests through each stack before the first pair")
    p.add_argument("--kv-transfer", choices=("tcp", "nixl"), help="default: tcp on CPU, pdserve up's on a GPU")
    p.add_argument("--worker-args", default="", help="more flags for every worker (e.g. --load-format dummy)")
    p.add_argument("--control", action="store_true",
                   help="a third stack without tracing (off2): off2/off is the same-run noise floor of the ratios")
    p.add_argument("--profile", action="store_true",
                   help="after the pairs, one run through the traced stack under py-spy: tracing's share of "
                        "each process's sampled stacks")
    p.add_argument("--span-cost", type=int, default=2000, metavar="N",
                   help="also time N requests' worth of tracing calls in-process (0: not)")
    p.add_argument("--together", action="store_true",
                   help="each pair's runs at the same time (not one after another): on a busy shared machine "
                        "the load drifts between runs; at once, every stack meets the same")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting pairs after this long (0: no bound)")
    args = p.parse_args(argv)
    # SIGTERM (a timeout's) unwinds like Ctrl-C: the stacks are stopped, not left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    machine = (f"{os.cpu_count()}-core {'CPU machine' if args.device == 'cpu' else 'GPU machine'} "
               f"({os.uname().nodename})")
    work = scratch_dir("pdserve-tracing-")
    if args.model is None:
        args.model = str(work / "tiny")
        make_checkpoint(args.model, smoke=True)
        args.model_name = "tiny random Llama (bench/disagg.py TINY: 2 layers, hidden 64)"
    else:
        args.model_name = Path(args.model).name
    args.kv_transfer = args.kv_transfer or ("tcp" if args.device == "cpu" else None)
    smoke = args.device == "cpu"
    tokenizer = dataset.load_tokenizer(args.model)
    os.environ.update({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0",
                       "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    stacks: dict[str, UpStack] = {}
    runs: list[dict] = []
    pairs: list[dict] = []
    with ReceiverProcess() as rx:
        flags = f"--otlp-traces-endpoint {rx.http_url}"
        try:
            variants = [("off", ""), ("on", flags)] + ([("off2", "")] if args.control else [])
            for name, tracing in variants:
                stacks[name] = UpStack(args.model, 1, 1, work / name, smoke, transport=args.kv_transfer,
                                       worker_args=f"{args.worker_args} {tracing}".strip(), router_args=tracing)
                stacks[name].start()
                print(f"[tracing] stack {name} ready: {stacks[name].children}", flush=True)
            pids = {name: stack_pids(s) for name, s in stacks.items()}
            warm = dataset.random_requests(tokenizer, args.warmup, args.input_len, args.output_len, seed=10_000)
            for name, s in stacks.items():
                one_run(s, pids[name], warm, args)
            # What the next pair will take: the last one's time. The first starts while any budget
            # is left (the warm-up, with its first-request compiles, says nothing about a pair's).
            pair_s = 0.0
            for k in range(args.pairs):
                if args.budget_s and time.monotonic() - t0 + pair_s > args.budget_s:
                    print(f"[tracing] budget spent: {k} pairs (the next would take ~{pair_s:.0f}s)", flush=True)
                    break
                t_pair = time.monotonic()
                specs = dataset.random_requests(tokenizer, args.requests, args.input_len, args.output_len, seed=k)
                names = [n for n, _ in variants]
                order = names[k % len(names):] + names[:k % len(names)]  # each first in turn
                pair = {"pair": k, "order": "together" if args.together else " then ".join(order)}
                both = together(stacks, pids, specs, args) if args.together else {}
                for name in order:
                    r = both[name] if args.together else one_run(stacks[name], pids[name], specs, args)
                    r.update(pair=k, stack=name)
                    runs.append(r)
                    pair[name] = r
                    print(f"[tracing] pair {k} {name}: {r['output_tok_s']:.1f} tok/s, ITL mean "
                          f"{r['itl_mean_ms']:.2f} ms, CPU {r['cpu_ms_per_req']:.1f} ms/req", flush=True)
                pairs.append(pair)
                pair_s = time.monotonic() - t_pair
                write_results(args, runs, pairs, None, {}, machine)  # a kill from here on still leaves these
            profile = None
            if args.profile:
                if py_spy() is None:
                    print("[tracing] --profile: py-spy not found, no profile", flush=True)
                else:
                    specs = dataset.random_requests(tokenizer, args.requests, args.input_len, args.output_len,
                                                    seed=5000)
                    profile = profile_run(stacks["on"], pids["on"], specs, args, args.out)
                    runs.append({**profile["run"], "pair": "profile", "stack": "on"})
            cost_us = span_cost(rx.http_url, args.span_cost) if args.span_cost else None
            # The SDK exports every 5 s by default: wait for the last batch before counting.
            traced = args.warmup + sum(r["completed"] for r in runs if r["stack"] == "on")
            per_request = spans_per_request(rx)
            deadline = time.monotonic() + 30
            while rx.count_not(COST_SERVICE) < traced * per_request and time.monotonic() < deadline:
                time.sleep(0.5)
            spans = {
                "received": rx.count_not(COST_SERVICE), "traced_requests": traced, "per_request": per_request,
                     "expected": traced * per_request}
            dropped = dropped_spans(stacks["on"])
        finally:
            for s in stacks.values():
                s.stop()
    text = write_results(args, runs, pairs, spans, dropped, machine, profile, cost_us)
    print(text)
    print(f"[tracing] total {time.monotonic() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
