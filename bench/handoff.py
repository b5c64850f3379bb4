"""Hand-off benchmark (issue 24, not a test): the stall after the first token, P/D against aggregated.

    python -m pdserve.bench.handoff --out DIR [--budget-s 520] [--seconds 20] [--chunk-tokens 512] [--smoke]
    python -m pdserve.bench.handoff --replot DIR      # results.md and the figure again from DIR/summary.json

On bench/disagg.py's random Llama-3.1-8B-shaped checkpoint (bf16, word tokenizer: exact prompt
lengths), five stacks started one after another with `pdserve up` (one start each; model load
is the cost, so every point of a stack runs before the next starts):

    agg        2 aggregated workers, one GPU each            load points at 1 and 6 req/s
    nixl-off   1 prefill + 1 decode over NIXL, overlap off   load points at 1 and 6 req/s, length sweep
    nixl-on    the same, overlap on                          load points at 1 and 6 req/s, length sweep
    tcp-off    1 + 1 over --kv-transfer tcp, overlap off     load point at 1 req/s, length sweep
    tcp-on     the same, overlap on                          load point at 1 req/s, length sweep

Overlap off = router `--pd-handoff after-prefill` + workers `--kv-stream-chunk-tokens 0`; on =
`--pd-handoff streamed` + `--kv-stream-chunk-tokens N` (--chunk-tokens). A checkout whose router
or worker lacks a flag gets none of it (said in the report); the on stacks are then skipped on a
GPU (they would measure the off path twice) and run anyway in --smoke (to check the script).

Workers run the engine's default scheduling (async with a GPU since 2026-11-28; synchronous:
`--worker-args=--no-async-scheduling`).

Load points: 3000 in / 200 out, Poisson arrivals, --seconds of sending (4 warm-up requests first
on each stack). Length sweep: 1k, 3k, 8k, 16k prompts, 5 sequential requests each after 1
warm-up, 32 out. bench/handoff_report.py turns the runs into results.md (tables, the stall
model's prediction for 2-50 GB/s links, issue 24's targets for overlap off and on, the stage
times), summary.json and first_gap_vs_prompt.png; DIR/runs.tar.gz keeps every run's JSON (per
request TTFT and every gap) and the stack logs. --budget-s: stacks share what is left in
proportion to their estimated cost; a point that would end past its stack's share is skipped
and named. --smoke: a tiny model on CPU, TCP only, small sizes (checks the script end to end).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench import dataset, disagg_report, handoff_report, serve, serve_metrics, server_metrics
from pdserve.bench.disagg import UpStack, finish, pack_runs, scratch_dir
from pdserve.cli.mps import GPU_SHARING

SLO = ("ttft:2000", "itl:25")
# --smoke checks the script, not a CPU's speed: its SLO holds on a slow CPU too, so "good" still counts.
SMOKE_SLO = ("ttft:120000", "itl:10000")


@dataclass(frozen=True)
class Sizes:
    input_len: int
    output_len: int
    rates: tuple[float, float]  # (low, high): every stack runs low, agg and nixl also high (tcp: --tcp-high-rate)
    lengths: tuple[int, ...]
    sweep_output_len: int
    sweep_requests: int
    max_model_len: int
    max_num_batched_tokens: int  # the disagg run's step budget, so the load points compare with it
    start_s: float  # first guesses of the costs; measured ones correct them (Runner.estimate)
    per_request_s: dict  # transport -> (a, b): a sweep request costs a + b * prompt tokens


# The sweep runs 3000 last: the first budget cut takes the length the 1 req/s load point also shows.
GPU = Sizes(3000, 200, (1, 6), (1024, 16384, 8192, 3000), 32, 5, 16640, 8704, 30.0,
            {"nixl": (0.25, 5e-5), "tcp": (0.25, 1.1e-4)})
SMOKE = Sizes(60, 8, (1, 3), (64, 256), 8, 2, 2048, 2048, 25.0, {"nixl": (0.3, 1e-3), "tcp": (0.3, 1e-3)})


@dataclass(frozen=True)
class StackSpec:
    name: str
    prefill: int
    decode: int
    transport: str | None  # None: aggregated
    overlap: bool | None


STACKS = (StackSpec("agg", 0, 2, None, None), StackSpec("nixl-off", 1, 1, "nixl", False),
          StackSpec("nixl-on", 1, 1, "nixl", True), StackSpec("tcp-off", 1, 1, "tcp", False),
          StackSpec("tcp-on", 1, 1, "tcp", True))
SMOKE_STACKS = tuple(s for s in STACKS if s.transport != "nixl")


def stream_split(worker_args: str) -> str:
    """The workers' --kv-stream-split: the one --worker-args names, else the default (auto)."""
    m = re.search(r"--kv-stream-split[ =](\w+)", worker_args or "")
    return m.group(1) if m else "auto"


def flag_support() -> dict[str, bool]:
    """Which of the contract's flags this checkout's router and worker know (from their --help)."""
    def knows(cmd: str, flag: str) -> bool:
        out = subprocess.run([sys.executable, "-m", "pdserve.cli.main", cmd, "--help"], capture_output=True,
                             text=True, timeout=60)
        return flag in out.stdout

    return {"--pd-handoff": knows("router", "--pd-handoff"),
            "--kv-stream-chunk-tokens": knows("worker", "--kv-stream-chunk-tokens")}


def stack_flags(spec: StackSpec, chunk: int, support: dict[str, bool]) -> tuple[str, str]:
    """(worker args, router args) for one stack: only flags this checkout knows."""
    if spec.transport is None:
        return "", ""
    worker = f"--kv-stream-chunk-tokens {chunk if spec.overlap else 0}" if support["--kv-stream-chunk-tokens"] else ""
    router = f"--pd-handoff {'streamed' if spec.overlap else 'after-prefill'}" if support["--pd-handoff"] else ""
    return worker, router


@dataclass(frozen=True)
class Point:
    kind: str  # load | sweep
    rate: float | None = None
    prompt_len: int | None = None


def points(spec: StackSpec, sizes: Sizes, tcp_high: bool = False) -> list[Point]:
    rates = sizes.rates if spec.transport in (None, "nixl") or tcp_high else sizes.rates[:1]
    sweep = [Point("sweep", prompt_len=L) for L in sizes.lengths] if spec.transport else []
    return [Point("load", rate=r) for r in rates] + sweep


def estimate(p: Point, spec: StackSpec, sizes: Sizes, seconds: float) -> float:
    """A first guess of a point's seconds: sending (or sequential requests), prompts, warm-up, drain."""
    if p.kind == "load":
        return seconds + 6 + sizes.output_len * 0.01
    a, b = sizes.per_request_s[spec.transport]
    return (sizes.sweep_requests + 1) * (a + b * p.prompt_len) + 2


class Runner:
    def __init__(self, args, sizes: Sizes, ckpt: str, work: Path, support: dict[str, bool]):
        self.args, self.sizes, self.ckpt, self.work, self.support = args, sizes, ckpt, work, support
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.stages: list[tuple[str, float]] = []
        self.skipped: list[str] = []
        self.runs: list[dict] = []
        self.start_costs: list[float] = []
        self.ratios: dict[str, list[float]] = {"load": [], "sweep": []}  # measured / first guess
        self.tokenizer = dataset.load_tokenizer(ckpt)

    def say(self, msg: str) -> None:
        print(f"[handoff {time.monotonic() - self.t0:5.0f}s] {msg}", flush=True)

    def stage(self, name: str, t: float) -> None:
        self.stages.append((name, time.monotonic() - t))
        self.say(f"stage {name}: {self.stages[-1][1]:.0f}s")

    def estimate(self, p: Point, spec: StackSpec) -> float:
        """The first guess scaled by how the points measured so far compared with theirs."""
        ratios = self.ratios[p.kind]
        scale = min(2.0, max(0.5, statistics.median(ratios))) if ratios else 1.0
        return estimate(p, spec, self.sizes, self.args.seconds) * scale

    def stack_cost(self, spec: StackSpec) -> float:
        start = max(self.start_costs) if self.start_costs else self.sizes.start_s
        return start + 5 + sum(self.estimate(p, spec) for p in points(spec, self.sizes, self.args.tcp_high_rate))

    def run_all(self, stacks: list[StackSpec], after_each) -> None:
        for k, spec in enumerate(stacks):
            left = self.deadline - time.monotonic()
            share_end = time.monotonic() + left * self.stack_cost(spec) / sum(map(self.stack_cost, stacks[k:]))
            todo = points(spec, self.sizes, self.args.tcp_high_rate)
            first = self.estimate(todo[0], spec)
            if left < self.stack_cost(spec) - sum(self.estimate(p, spec) for p in todo) + first:
                self.skipped.append(f"{spec.name} (whole stack: {left:.0f}s left)")
                self.say(f"budget: skipping stack {spec.name} ({left:.0f}s left)")
                continue
            self.run_stack(spec, todo, share_end)
            after_each()  # the report so far: a kill past the budget keeps it

    def run_stack(self, spec: StackSpec, todo: list[Point], share_end: float) -> None:
        worker, router = stack_flags(spec, self.args.chunk_tokens, self.support)
        extra = f"--max-num-batched-tokens {self.sizes.max_num_batched_tokens} {worker} {self.args.worker_args}".strip()
        stack = UpStack(self.ckpt, spec.prefill, spec.decode, self.work / "logs" / spec.name, self.args.smoke,
                        transport=spec.transport, max_model_len=self.sizes.max_model_len, worker_args=extra,
                        router_args=router, gpu_sharing=self.args.gpu_sharing)
        t = time.monotonic()
        self.say(f"{spec.name}: starting (worker flags '{extra}', router flags '{router}')")
        try:
            try:
                stack.start()
            except RuntimeError as e:
                self.skipped.append(f"{spec.name} (did not start: see runs.tar.gz logs/{spec.name})")
                self.say(f"{spec.name}: did not start: {str(e)[-1500:]}")
                return
            self.start_costs.append(time.monotonic() - t)
            self.stage(f"{spec.name} start", t)
            for i, p in enumerate(todo):
                what = f"{spec.name} {p.kind} {p.rate if p.kind == 'load' else p.prompt_len}"
                if time.monotonic() + self.estimate(p, spec) > share_end:
                    self.skipped.append(f"{what} (budget)")
                    self.say(f"budget: skipping {what} ({share_end - time.monotonic():.0f}s left of its stack's share)")
                    continue
                t = time.monotonic()
                try:
                    self.runs.append(self.measure(stack, spec, p, warmup=self.args.warmup if i == 0 else 0))
                    self.ratios[p.kind].append(
                        (time.monotonic() - t) / estimate(p, spec, self.sizes, self.args.seconds)
                    )
                except Exception as e:  # noqa: BLE001 - a failed point is reported; the rest still runs
                    self.skipped.append(f"{what} (failed: {type(e).__name__}: {e})")
                    self.say(f"{what}: failed: {e!r}")
                self.stage(what, t)
        finally:
            t = time.monotonic()
            stack.stop()
            self.stage(f"{spec.name} stop", t)

    def measure(self, stack: UpStack, spec: StackSpec, p: Point, warmup: int) -> dict:
        """One point through bench/serve.py's load generator (the tokenizer loaded once per run)."""
        s, seconds = self.sizes, self.args.seconds
        seed = 7919 * (len(self.runs) + 1)  # fresh prompts per point: nothing hits the prefix cache
        base = stack.children["router"]
        if p.kind == "load":
            label, in_len, out_len, n = spec.name, s.input_len, s.output_len, None
            cfg = serve.LoadConfig(base, "llama", request_rate=p.rate, duration_s=seconds, request_timeout_s=120,
                                   seed=seed, progress=False)
        else:  # sequential: a closed loop of one; one warm-up per length (kernels specialise on it)
            label, in_len, out_len, n = (
                f"{spec.name}-len{p.prompt_len}",
                p.prompt_len,
                s.sweep_output_len,
                s.sweep_requests,
            )
            cfg = serve.LoadConfig(base, "llama", concurrency=1, request_timeout_s=120, seed=seed, progress=False)
            warmup = 1
        if warmup:
            warm = dataset.random_requests(self.tokenizer, warmup, in_len, out_len, seed=seed + 1)
            run_async(
                serve.run_load(serve.LoadConfig(base, "llama", concurrency=cfg.concurrency, progress=False), warm)
            )
        specs = dataset.random_requests(self.tokenizer, serve.prompts_needed(cfg, n), in_len, out_len, seed=seed)
        urls = list(stack.children.values())
        before = server_metrics.scrape_all(urls)
        results, duration = run_async(serve.run_load(cfg, specs))
        deltas = server_metrics.delta(before, server_metrics.scrape_all(urls))
        summary = serve_metrics.summarize(results, duration, serve_metrics.parse_goodput(
            list(SMOKE_SLO if self.args.smoke else SLO)))
        if not summary["completed"]:
            raise RuntimeError(f"no request completed: {summary['errors']}")
        run = serve.run_record(serve.Workload(label, in_len, out_len), cfg, summary, results, deltas)
        run.update(stack=spec.name, transport=spec.transport, overlap=spec.overlap, kind=p.kind,
                   roles={u: n for n, u in stack.children.items()})
        path = self.work / "runs" / f"{label}_rate-{serve.rate_name(cfg.request_rate)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run))
        r = handoff_report.row(run)
        self.say(f"{label} @ {serve.rate_name(cfg.request_rate)}: first gap p50/p99 {r['first_gap_p50_ms']:.1f}/"
                 f"{r['first_gap_p99_ms']:.1f} ms, steady ITL p50 {r['steady_itl_p50_ms']:.1f} ms, TTFT p50 "
                 f"{r['ttft_p50_ms']:.0f} ms, good {r['good']}/{r['sent']}, failed {r['failed']}")
        return run


def run_async(coro):
    """As `pdserve bench serve` runs its load: on uvloop where installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def summarize(runner: Runner | None, args, sizes: Sizes, ckpt: str, support: dict[str, bool]) -> dict:
    rows = [handoff_report.row(r) for r in runner.runs] if runner else []
    cfg_path = Path(ckpt) / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    per_token = handoff_report.kv_bytes_per_token(config) if config else 0
    # GIT_COMMIT: the caller's word (a device machine's copy of .git may be older than its tree).
    commit = os.environ.get("GIT_COMMIT", "")
    try:
        repo = Path(__file__).resolve().parents[1]  # through gpu_env.sh's link farm too
        commit = commit or subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"],
                                          capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    missing = [f for f, ok in support.items() if not ok]
    note = (f"This checkout lacks {' and '.join(f'`{f}`' for f in missing)}: no stack got "
            f"{'it' if len(missing) == 1 else 'them'}, so 'overlap on' (where run) measured the off path."
            if missing else "")
    model = (f"{'tiny Llama (smoke)' if args.smoke else 'Llama-3.1-8B shape, random bf16'}: "
             f"{config.get('num_hidden_layers')} layers, {config.get('num_key_value_heads')} KV heads, "
             f"{per_token} KV bytes/token")
    return {"environment": disagg_report.environment(args.smoke), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": {"model": model, "chunk_tokens": args.chunk_tokens, "seconds": args.seconds,
                       "gpu_sharing": args.gpu_sharing or "auto",
                       "input_len": sizes.input_len, "output_len": sizes.output_len, "rates": list(sizes.rates),
                       "lengths": sorted(sizes.lengths), "sweep_requests": sizes.sweep_requests,
                       "sweep_output_len": sizes.sweep_output_len, "max_model_len": sizes.max_model_len,
                       "max_num_batched_tokens": sizes.max_num_batched_tokens, "budget_s": args.budget_s,
                       "stream_split": stream_split(args.worker_args),
                       "kv_bytes_per_token": per_token},
            "flags": support, "flags_note": note, "rows": rows,
            "stages": runner.stages if runner else [], "skipped": runner.skipped if runner else []}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench handoff", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", help="results.md, summary.json, the figure, runs.tar.gz")
    p.add_argument("--replot", metavar="DIR", help="only redraw DIR's results.md and figure from its summary.json")
    p.add_argument("--seconds", type=float, default=None, help="sending time per load point (default 20, smoke 4)")
    p.add_argument(
        "--budget-s", type=float, default=None, help="skip what would end past this (default 520, smoke 400)"
    )
    p.add_argument("--chunk-tokens", type=int, default=None, help="--kv-stream-chunk-tokens of overlap on "
                   "(default 512, smoke 32)")
    p.add_argument("--worker-args", default="", help="more flags for every worker of every stack, aggregated "
                                                     "included (e.g. --async-scheduling)")
    p.add_argument("--gpu-sharing", default=None, choices=GPU_SHARING,
                   help="`pdserve up --gpu-sharing` for every stack (default: up's, auto: MPS where a card is shared)")
    p.add_argument("--warmup", type=int, default=4, help="requests sent (all at once) before a stack's first point")
    p.add_argument("--tcp-high-rate", action="store_true", help="TCP stacks run the high load point too")
    p.add_argument("--stacks", default=None, help="comma-separated subset of agg,nixl-off,nixl-on,tcp-off,tcp-on")
    p.add_argument("--no-overlap-flags", action="store_true", help="pass neither flag (a checkout without them)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, TCP only (checks the script)")
    p.add_argument("--checkpoint", metavar="DIR", help="reuse this checkpoint (bench/disagg.py --make-checkpoint)")
    args = p.parse_args(argv)
    if args.replot:
        d = Path(args.replot)
        for path in handoff_report.render(json.loads((d / "summary.json").read_text()), d):
            print(f"wrote {path}")
        return 0
    if not args.out:
        p.error("--out: required (or --replot DIR)")
    sizes = SMOKE if args.smoke else GPU
    args.seconds = args.seconds or (4.0 if args.smoke else 20.0)
    args.budget_s = args.budget_s or (400.0 if args.smoke else 520.0)
    args.chunk_tokens = args.chunk_tokens if args.chunk_tokens is not None else (32 if args.smoke else 512)
    stacks = list(SMOKE_STACKS if args.smoke else STACKS)
    if args.stacks:
        names = args.stacks.split(",")
        if unknown := [n for n in names if n not in {s.name for s in STACKS}]:
            p.error(f"--stacks: unknown {', '.join(unknown)}")
        stacks = [s for s in STACKS if s.name in names]
    t0 = time.monotonic()
    # timeout(1) sends SIGTERM: unwind, so the stack is stopped and the report written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    support = (
        {f: False for f in ("--pd-handoff", "--kv-stream-chunk-tokens")} if args.no_overlap_flags else flag_support()
    )
    print(f"[handoff] flags in this checkout: {support}", flush=True)
    if not all(support.values()) and not args.smoke:
        stacks = [s for s in stacks if not s.overlap]
        print("[handoff] overlap-on stacks skipped: this checkout's router/worker lack the flags", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = scratch_dir("pdserve-handoff-")
    ckpt = args.checkpoint or str(work / "ckpt")
    runner = None
    try:
        if not args.checkpoint:
            t = time.monotonic()
            # In a child process, so this one never holds a CUDA context the workers' memory sizing sees.
            subprocess.run([sys.executable, "-m", "pdserve.bench.disagg", "--out", str(out), "--make-checkpoint", ckpt,
                            *(["--smoke"] if args.smoke else [])], check=True)
            print(f"[handoff] checkpoint: {time.monotonic() - t:.0f}s", flush=True)
        runner = Runner(args, sizes, ckpt, work, support)
        runner.t0, runner.deadline = t0, t0 + args.budget_s
        if not args.checkpoint:
            runner.stages.append(("checkpoint", time.monotonic() - t))
        runner.say(f"plan: {', '.join(f'{s.name} (~{runner.stack_cost(s):.0f}s)' for s in stacks)}")
        runner.run_all(stacks, lambda: handoff_report.render(summarize(runner, args, sizes, ckpt, support), out))
    finally:
        summary = summarize(runner, args, sizes, ckpt, support)
        handoff_report.render(summary, out)
        pack_runs(work, out)
    return finish(out, "handoff", t0)


if __name__ == "__main__":
    sys.exit(main())
