"""Flow control under a noisy tenant (issue 49's "Measure"): the quiet tenant's TTFT with and
without the router's flow control, and a more urgent band's TTFT against a less urgent one's.

    python tools/flow_fairness.py --out DIR [--model PATH] [--workers 1] [--seconds 40] [--load 1.4]
        [--batch 32] [--reps 2]

Two `pdserve up` stacks side by side on one checkpoint (without --model: bench/disagg.py's tiny
random Llama), each --workers aggregated CPU workers (`--max-num-seqs` --batch) behind a router:
"fifo" without flow control (every request goes to a worker at once and waits in the engine's
FIFO queue), "flow" with `--flow-control-max-inflight` --batch x --workers (the router keeps the
workers' batches full and no more; the rest wait in its queue, by band, then fairly between
tenants), so both pools run the same batches. First the pool's capacity: a closed loop of
--batch x --workers on the fifo stack gives requests/s. Then, per scenario, the same seeded Poisson
arrivals (streamed completions, exact prompt and output lengths, ignore_eos) for --seconds at
--load x that capacity into each stack in turn, stack order alternating between repetitions:

    noisy-quiet  tenant "noisy" at 10x tenant "quiet"'s rate (x-gateway-inference-fairness-id),
                 one band: the quiet tenant's TTFT p50/p99, the noisy one's, 429s per tenant
    bands        one tenant, a quarter of the requests in band -1 (x-pdserve-priority: -1),
                 the rest in band 1: each band's TTFT

A request refused (429) counts in its tenant's "refused", not in its TTFT. Each run waits for
every answer (the fifo stack drains its backlog) before the next starts. DIR gets results.md,
runs.json and fairness.png (TTFT distributions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench import dataset, serve, serve_metrics
from pdserve.bench.disagg import UpStack, make_checkpoint, scratch_dir
from pdserve.bench.serve_client import stream_request


@dataclass(frozen=True)
class Stream:
    """One class of requests: who sends them (headers) and at what share of the total rate."""

    name: str
    share: float
    headers: dict


SCENARIOS = {
    "noisy-quiet": (Stream("noisy", 10 / 11, {"x-gateway-inference-fairness-id": "noisy"}),
                    Stream("quiet", 1 / 11, {"x-gateway-inference-fairness-id": "quiet"})),
    "bands": (Stream("band -1 (urgent)", 0.25, {"x-pdserve-priority": "-1"}),
              Stream("band 1 (batch)", 0.75, {"x-pdserve-priority": "1"})),
}


async def open_loop(url: str, streams, rate: float, seconds: float, specs, seed: int) -> dict[str, list]:
    """Poisson arrivals at `rate` for `seconds`, each request drawn into a stream by its share;
    every answer awaited. -> stream name -> RequestResults."""
    import aiohttp

    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    sessions = {s.name: aiohttp.ClientSession(headers=s.headers, timeout=timeout,
                                              connector=aiohttp.TCPConnector(limit=0)) for s in streams}
    tasks: list[tuple[str, asyncio.Task]] = []
    try:
        t0 = time.perf_counter()
        due = t0
        i = 0
        while True:
            due += rng.expovariate(rate)
            if due - t0 >= seconds:
                break
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            pick = rng.random()
            stream = next((s for s in streams if (pick := pick - s.share) < 0), streams[-1])
            task = asyncio.create_task(stream_request(sessions[stream.name], url, "completions", "llama",
                                                      specs[i % len(specs)]))
            tasks.append((stream.name, task))
            i += 1
        results = await asyncio.gather(*(t for _, t in tasks))
    finally:
        for s in sessions.values():
            await s.close()
    out: dict[str, list] = {s.name: [] for s in streams}
    for (name, _), r in zip(tasks, results):
        out[name].append(r)
    return out


def stats(results: list) -> dict:
    ok = [r.ttft for r in results if r.ok]
    s = serve_metrics._stats(ok)
    refused = sum(1 for r in results if r.error and r.error.startswith("http_429"))
    return {"sent": len(results), "answered": len(ok), "refused_429": refused,
            "failed_other": len(results) - len(ok) - refused,
            "errors": dict(Counter(r.error for r in results if r.error)),
            "ttft_p50_ms": s["p50"] * 1e3, "ttft_p90_ms": s["p90"] * 1e3, "ttft_p99_ms": s["p99"] * 1e3,
            "ttft_max_ms": max(ok, default=float("nan")) * 1e3, "ttfts_ms": [t * 1e3 for t in ok]}


def capacity(stack: UpStack, tokenizer, args) -> float:
    specs = dataset.random_requests(tokenizer, args.max_inflight * 4, args.input_len, args.output_len, seed=999)
    cfg = serve.LoadConfig(base_url=stack.children["router"], model="llama", concurrency=args.max_inflight,
                           progress=False)
    results, duration = asyncio.run(serve.run_load(cfg, specs))
    return sum(r.ok for r in results) / duration


def report(args, cap: float, rows: list[dict]) -> str:
    lines = [f"Workload: streamed completions, {args.input_len} prompt / {args.output_len} output tokens "
             f"(ignore_eos), Poisson arrivals for {args.seconds:.0f} s at {args.load}x the pool's capacity "
             f"({cap:.2f} req/s: a closed loop of {args.max_inflight} on the same pool), {args.workers} aggregated "
             f"worker(s) of {args.model_name} (`--max-num-seqs {args.batch}`) behind one router; flow control: "
             f"`--flow-control-max-inflight {args.max_inflight}`, defaults otherwise (queue 256, timeout 30 s); "
             f"{args.reps} repetition(s), "
             f"stack order alternating. {args.machine}.", "",
             "| scenario | router | stream | sent | answered | 429 | TTFT p50 ms | p90 | p99 | max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    merged: dict[tuple, list] = {}
    for r in rows:
        merged.setdefault((r["scenario"], r["stack"], r["stream"]), []).append(r)
    for (scenario, stack, stream), rs in merged.items():
        ttfts = sorted(t for r in rs for t in r["ttfts_ms"])
        s = serve_metrics._stats(ttfts)
        lines.append(f"| {scenario} | {'flow control' if stack == 'flow' else 'no flow control'} | {stream} | "
                     f"{sum(r['sent'] for r in rs)} | {sum(r['answered'] for r in rs)} | "
                     f"{sum(r['refused_429'] for r in rs)} | {s['p50']:.0f} | {s['p90']:.0f} | {s['p99']:.0f} | "
                     f"{max(ttfts, default=float('nan')):.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(12, 4.2))
    for ax, scenario in zip(axes, SCENARIOS):
        for stack, style in (("fifo", "--"), ("flow", "-")):
            for stream in SCENARIOS[scenario]:
                ttfts = sorted(t / 1e3 for r in rows if (r["scenario"], r["stack"], r["stream"]) ==
                               (scenario, stack, stream.name) for t in r["ttfts_ms"])
                if ttfts:
                    ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], style,
                            label=f"{stream.name}, {'flow control' if stack == 'flow' else 'no flow control'}")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log)")
        ax.set_ylabel("fraction of answered requests")
        ax.set_title(scenario)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--load", type=float, default=1.4, help="offered rate as a multiple of the measured capacity")
    p.add_argument("--batch", type=int, default=32, help="each worker's --max-num-seqs")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args(argv)
    # SIGTERM (a timeout's) unwinds like Ctrl-C: the stacks are stopped, not left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    import os

    args.machine = f"{os.cpu_count()}-core CPU machine ({os.uname().nodename})"
    work = scratch_dir("pdserve-fairness-")
    if args.model is None:
        args.model = str(work / "tiny")
        make_checkpoint(args.model, smoke=True)
        args.model_name = "a tiny random Llama (bench/disagg.py TINY)"
    else:
        args.model_name = Path(args.model).name
    tokenizer = dataset.load_tokenizer(args.model)
    args.max_inflight = args.batch * args.workers
    batch = f"--max-num-seqs {args.batch}"
    flow = f"--flow-control-max-inflight {args.max_inflight}"
    stacks = {"fifo": UpStack(args.model, 0, args.workers, work / "fifo", True, worker_args=batch),
              "flow": UpStack(args.model, 0, args.workers, work / "flow", True, worker_args=batch, router_args=flow)}
    rows: list[dict] = []
    try:
        for s in stacks.values():
            s.start()
        cap = capacity(stacks["fifo"], tokenizer, args)
        rate = args.load * cap
        print(f"[fairness] capacity {cap:.2f} req/s at {args.max_inflight} in flight; offering {rate:.2f} req/s",
              flush=True)
        n = int(rate * args.seconds * 1.2) + 10
        for rep in range(args.reps):
            for scenario in args.scenarios.split(","):
                specs = dataset.random_requests(tokenizer, n, args.input_len, args.output_len, seed=100 * rep + 1)
                order = ("fifo", "flow") if rep % 2 == 0 else ("flow", "fifo")
                for name in order:
                    url = stacks[name].children["router"] + "/v1/completions"
                    got = asyncio.run(open_loop(url, SCENARIOS[scenario], rate, args.seconds, specs, seed=rep))
                    for stream, results in got.items():
                        row = {"scenario": scenario, "stack": name, "rep": rep, "stream": stream, **stats(results)}
                        rows.append(row)
                        print(f"[fairness] rep {rep} {scenario} {name} {stream}: sent {row['sent']}, 429 "
                              f"{row['refused_429']}, other failures {row['errors']}, TTFT p50 "
                              f"{row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms", flush=True)
        rejected = httpx.get(stacks["flow"].children["router"] + "/metrics", timeout=10).text
        rejected = [line for line in rejected.splitlines() if line.startswith("pdserve_router_flow_rejected_total{")]
    finally:
        for s in stacks.values():
            s.stop()
    text = report(args, cap, rows) + "\nThe flow-control router's refusals over the whole run " \
        "(pdserve_router_flow_rejected_total):\n\n" + "".join(f"    {line}\n" for line in rejected)
    (args.out / "results.md").write_text(text)
    (args.out / "runs.json").write_text(json.dumps({"capacity_req_s": cap, "rows": rows,
                                                    "args": {k: str(v) for k, v in vars(args).items()}}, indent=0))
    plot(rows, args.out / "fairness.png")
    print(text)
    print(f"[fairness] total {time.monotonic() - t0:.0f}s; medians per run in runs.json "
          f"({statistics.median(r['ttft_p50_ms'] for r in rows if r['answered']):.0f} ms overall)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
