"""`pdserve bench serve`: an OpenAI-compatible load generator, in the spirit of `vllm bench serve`
(same metric names and meanings, so numbers compare).

    pdserve bench serve --base-url http://127.0.0.1:8000 --model NAME [--tokenizer PATH]
        [--endpoint completions|chat] [--input-len 1024 --output-len 128 --range-ratio 0 | --dataset FILE.jsonl]
        [--num-requests 200 | --duration S] [--concurrency C] [--request-rate R [--burstiness 1]]
        [--sweep-rates 1,2,4] [--goodput ttft:MS itl:MS e2e:MS] [--seed 0] [--out DIR --label NAME]
        [--metrics-url URL ...] [--lora-adapters A,B,C [--lora-pick round-robin|random]]
        [--multi-turn N M [--conversation-rate R] [--think-time S]]

Every request streams, with `ignore_eos` so outputs are exactly `--output-len` tokens. Arrivals
are a gamma process (`--burstiness 1`: Poisson) at `--request-rate`, or all at once when the
rate is inf; `--concurrency` caps requests in flight either way. Each rate of `--sweep-rates`
gets fresh random prompts, so no run hits the prefix cache of an earlier one. `--out` gets one
JSON per run and PNG plots (bench/plot.py); `--metrics-url` scrapes servers' /metrics around
each run into that JSON. Without `--tokenizer` the tokenizer is found from the server's
/v1/models card (bench/serve_tokenizer.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench import dataset, server_metrics, serve_tokenizer
from pdserve.bench.serve_metrics import RequestResult, format_summary, parse_goodput, summarize


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf  # requests/s; inf = all at once (closed loop under --concurrency)
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    concurrency: int | None = None
    duration_s: float | None = None  # stop sending after this long (else send every request)
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    seed: int = 0
    progress: bool = True
    # LoRA adapters whose names the requests carry as `model` instead of `model` (issue 48):
    # spread over them round-robin or at random (seeded); empty: every request names `model`.
    lora_adapters: tuple[str, ...] = ()
    lora_pick: str = "round-robin"
    # Multi-turn mode: conversations start at this rate (gamma gaps of shape `burstiness`; inf: all
    # at once), and each later turn is sent a think time (exponential, this mean) after its
    # previous turn ended. Real chat traffic: a conversation's turns are apart, conversations overlap.
    conversation_rate: float = math.inf
    think_time_s: float = 0.0

    def __post_init__(self):
        from pdserve.bench.serve_client import ENDPOINTS

        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint: must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate: must be > 0 (inf for all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness: must be > 0, got {self.burstiness}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency: must be >= 1, got {self.concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration: must be > 0 seconds, got {self.duration_s}")
        if any(not name for name in self.lora_adapters):
            raise ValueError(f"--lora-adapters: empty adapter name in {','.join(self.lora_adapters)!r}")
        if self.lora_pick not in LORA_PICKS:
            raise ValueError(f"--lora-pick: must be one of {', '.join(LORA_PICKS)}, got {self.lora_pick!r}")
        if not self.conversation_rate > 0:
            raise ValueError(f"--conversation-rate: must be > 0 (inf for all at once), got {self.conversation_rate}")
        if not self.think_time_s >= 0:
            raise ValueError(f"--think-time: must be >= 0 seconds, got {self.think_time_s}")


LORA_PICKS = ("round-robin", "random")


def request_models(cfg: LoadConfig):
    """The `model` of each request in send order (endless): `cfg.model`, or its adapters
    round-robin or drawn at random with their own seeded generator (the arrival times stay those
    of the same seed without adapters)."""
    import itertools
    import random

    if not cfg.lora_adapters:
        return itertools.repeat(cfg.model)
    if cfg.lora_pick == "round-robin":
        return itertools.cycle(cfg.lora_adapters)
    rng = random.Random(f"lora-{cfg.seed}")
    return (rng.choice(cfg.lora_adapters) for _ in itertools.count())


def arrival_gaps(rate: float, burstiness: float, rng) -> "iter[float]":
    """Seconds between sends: gamma with mean 1/rate and shape `burstiness` (vLLM's definition)."""
    while True:
        yield 0.0 if math.isinf(rate) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def multi_turn_schedule(specs: list[dataset.RequestSpec], conversation_rate: float, burstiness: float,
                        think_time_s: float, rng) -> list[float]:
    """Per spec of a multi-turn list (turn-major), seconds: for a conversation's first turn, its
    start after the previous conversation's (gamma gaps of mean 1/`conversation_rate`; 0 when the
    rate is inf); for a later turn, the think time between the previous turn's end and its send
    (exponential of mean `think_time_s`; 0 when that is 0). Drawn in spec order from `rng`, so a
    seed gives one schedule."""
    gaps = arrival_gaps(conversation_rate, burstiness, rng)
    out = []
    for spec in specs:
        if spec.turn == 0:
            out.append(next(gaps))
        else:
            out.append(rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0)
    return out


async def run_load(cfg: LoadConfig, specs: list[dataset.RequestSpec]) -> tuple[list[RequestResult], float]:
    """Send `specs` (cycled while --duration lasts); return results in send order and the run's
    duration (first send -> last completion)."""
    import random

    import aiohttp
    from tqdm import tqdm

    from pdserve.bench.serve_client import ENDPOINTS, stream_request

    url = cfg.base_url.rstrip("/").removesuffix("/v1") + ENDPOINTS[cfg.endpoint]
    rng = random.Random(cfg.seed)
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    closed_loop = math.isinf(cfg.request_rate) and gate is not None
    total = None if cfg.duration_s else len(specs)
    bar = tqdm(total=total, unit="req", disable=not cfg.progress, leave=False, dynamic_ncols=True)
    connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    tasks: list[asyncio.Task] = []

    # Multi-turn: each conversation's turn waits for its previous turn to finish (and its think
    # time after that). Staggered (--conversation-rate / --think-time): conversations start on
    # their own schedule, not the --request-rate gaps of the turn-major list.
    turn_done: dict[int, asyncio.Event] = {}
    staggered = bool(specs) and specs[0].conversation is not None and (
        not math.isinf(cfg.conversation_rate) or cfg.think_time_s > 0)
    schedule = multi_turn_schedule(specs, cfg.conversation_rate, cfg.burstiness, cfg.think_time_s, rng) \
        if staggered else None

    async def one(session, spec, due: float, model: str, after: asyncio.Event | None, done: asyncio.Event | None,
                  think: float = 0.0) -> RequestResult:
        try:
            if after is not None:
                await after.wait()
                # Its arrival is its previous turn's end plus the think time, not the schedule.
                due = time.perf_counter() + think
                if think > 0:
                    await asyncio.sleep(due - time.perf_counter())
            if gate is not None and not closed_loop:
                async with gate:
                    r = await stream_request(session, url, cfg.endpoint, model, spec, cfg.ignore_eos)
            else:
                r = await stream_request(session, url, cfg.endpoint, model, spec, cfg.ignore_eos)
            r.send_lag = 0.0 if closed_loop else r.start - due
            r.model = model
            return r
        finally:
            if done is not None:
                done.set()
            if closed_loop:
                gate.release()
            bar.update(1)

    # Everything allocated so far (tokenizer, prompts) leaves the collector's view, so a full
    # collection during the run does not stall the event loop for milliseconds (as vLLM's bench).
    gc.collect()
    gc.freeze()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        gaps = arrival_gaps(cfg.request_rate, cfg.burstiness, rng)
        models = request_models(cfg)
        t0 = time.perf_counter()
        due = t0
        i = 0
        while True:
            if cfg.duration_s is None and i >= len(specs):
                break
            spec = specs[i % len(specs)]
            think = 0.0
            if schedule is None:
                due += next(gaps)
            elif spec.turn == 0:
                due += schedule[i]
            else:
                think = schedule[i]
            if cfg.duration_s is not None and due - t0 >= cfg.duration_s:
                break
            # Sleep to an absolute due time, so event-loop lag never accumulates into the rate.
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            if closed_loop:
                await gate.acquire()
                if cfg.duration_s is not None and time.perf_counter() - t0 >= cfg.duration_s:
                    gate.release()
                    break
            after = done = None
            if spec.conversation is not None:
                after = turn_done.get(spec.conversation) if spec.turn else None
                done = turn_done[spec.conversation] = asyncio.Event()
            tasks.append(asyncio.create_task(one(session, spec, due, next(models), after, done, think)))
            i += 1
        results = list(await asyncio.gather(*tasks))
    gc.unfreeze()
    bar.close()
    starts = [r.start for r in results]
    ends = [r.start + r.e2e for r in results if r.ok]
    duration = (max(ends, default=time.perf_counter()) - min(starts)) if starts else 0.0
    return results, duration


def prompts_needed(cfg: LoadConfig, num_requests: int | None) -> int:
    if num_requests:
        return num_requests
    if not math.isinf(cfg.request_rate):
        return math.ceil(cfg.request_rate * cfg.duration_s * 1.25) + 16
    return 1024  # closed loop for --duration: cycled (a reused prompt may hit the prefix cache)


@dataclass(frozen=True)
class Workload:
    """What a run's record says about the requests it sent: this command's flags (from_args), or
    a harness's own (bench/handoff.py), named field by field so neither can miss one."""

    label: str
    input_len: int | None  # None: the lengths come from the dataset
    output_len: int
    range_ratio: float = 0.0
    dataset: str | None = None
    multi_turn: tuple[int, int] | None = None  # (conversations, turns)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        return cls(args.label, None if args.dataset else args.input_len, args.output_len, args.range_ratio,
                   args.dataset, tuple(args.multi_turn) if args.multi_turn else None)


def run_record(work: Workload, cfg: LoadConfig, summary: dict, results: list[RequestResult], deltas: dict) -> dict:
    return {
        "label": work.label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": cfg.base_url,
        "model": cfg.model,
        "lora_adapters": list(cfg.lora_adapters),
        "lora_pick": cfg.lora_pick if cfg.lora_adapters else None,
        "endpoint": cfg.endpoint,
        "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "multi_turn": list(work.multi_turn) if work.multi_turn else None,
        "conversation_rate": None if math.isinf(cfg.conversation_rate) else cfg.conversation_rate,
        "think_time_s": cfg.think_time_s,
        "concurrency": cfg.concurrency,
        "duration_limit_s": cfg.duration_s,
        "input_len": work.input_len,
        "output_len": work.output_len,
        "range_ratio": work.range_ratio,
        "dataset": work.dataset,
        "seed": cfg.seed,
        "summary": summary,
        "server_metrics": deltas,
        "requests": [
            {
                "start": round(r.start - results[0].start, 6),
                "model": r.model,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "server_prompt_tokens": r.server_prompt_tokens,
                "output_tokens": r.output_tokens,
                "send_lag": round(r.send_lag, 6),
                "ttft": round(r.ttft, 6),
                "e2e": round(r.e2e, 6),
                "itls": [round(g, 6) for g in r.itls],
                "error": r.error,
            }
            for r in results
        ],
    }


# ---- command line ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory or hub id (default: the root of the model's /v1/models card, else --model)",
    )
    p.add_argument("--endpoint", default="completions", choices=("completions", "chat"))
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens of random prompts (default 1024)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (sent as max_tokens with ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random lengths uniform in [len*(1-R), len*(1+R)], 0 <= R < 1")
    p.add_argument("--dataset", default=None, metavar="FILE.jsonl", help='lines of {"prompt": str, "output_len"?: int}')
    p.add_argument("--multi-turn", nargs=2, type=int, default=None, metavar=("N", "M"),
                   help="N conversations x M turns: each turn sends the whole history plus a new message of "
                        "--input-len tokens, once the conversation's previous turn finished (replies in the "
                        "history are random text of --output-len tokens); N*M requests")
    p.add_argument("--conversation-rate", type=float, default=math.inf, metavar="R",
                   help="with --multi-turn: conversations start at R per second (gamma gaps, --burstiness; "
                        "default inf: all at once) instead of every first turn at once")
    p.add_argument("--think-time", type=float, default=0.0, metavar="SECONDS",
                   help="with --multi-turn: mean seconds (exponential) between a turn's end and the next turn's "
                        "send (default 0: at once)")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--num-requests", type=int, default=None, help="requests per run (default 200)")
    n.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="send for this long, then drain")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument(
        "--sweep-rates", default=None, metavar="R1,R2,...", help="one run per rate (overrides --request-rate)"
    )
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="per-request SLOs: ttft, tpot, itl (largest gap), e2e; e.g. ttft:2000 itl:25")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-adapters", default="", metavar="A,B,C",
                   help="LoRA adapter names to send as each request's model (--model stays the tokenizer's base)")
    p.add_argument("--lora-pick", default="round-robin", choices=LORA_PICKS,
                   help="how requests spread over --lora-adapters: in turn, or at random with --seed")
    p.add_argument("--warmup-requests", type=int, default=0, help="sent (and not measured) before the first run")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="a server whose /metrics is scraped before and after each run (repeatable)")
    p.add_argument("--out", default=None, metavar="DIR", help="write one JSON per run and PNG plots here")
    p.add_argument("--label", default="run", help="names this setup's curve in plots and its JSON files")
    p.add_argument("--no-plots", action="store_true", help="with --out: JSON only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _rates(args) -> list[float]:
    if args.sweep_rates is None:
        return [args.request_rate]
    try:
        rates = [float(x) for x in args.sweep_rates.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-rates: expected numbers separated by commas, got {args.sweep_rates!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep-rates: every rate must be > 0, got {args.sweep_rates!r}")
    return rates


def configs_from_args(args) -> tuple[list[LoadConfig], dict[str, float]]:
    """Raises ValueError whose message starts with the offending flag."""
    if args.dataset and args.input_len is not None:
        raise ValueError("--input-len: not used with --dataset (prompt lengths come from the file)")
    if args.dataset and not Path(args.dataset).is_file():
        raise ValueError(f"--dataset: no such file: {args.dataset}")
    if args.multi_turn is not None:
        if args.dataset:
            raise ValueError("--multi-turn: not used with --dataset (turns are generated)")
        if args.num_requests is not None or args.duration is not None:
            raise ValueError("--multi-turn: sends N*M requests; not with --num-requests or --duration")
        if min(args.multi_turn) < 1:
            raise ValueError(f"--multi-turn: N and M must be >= 1, got {args.multi_turn}")
        if not math.isinf(args.conversation_rate) and (args.sweep_rates or not math.isinf(args.request_rate)):
            raise ValueError("--conversation-rate: paces conversations; not with --request-rate or --sweep-rates")
    else:
        for flag, value, unset in (("--conversation-rate", args.conversation_rate, math.inf),
                                   ("--think-time", args.think_time, 0.0)):
            if value != unset:
                raise ValueError(f"{flag}: only with --multi-turn")
    if args.input_len is None:
        args.input_len = 1024
    for flag, value in (("--input-len", args.input_len), ("--output-len", args.output_len),
                        ("--num-requests", args.num_requests)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio: must be in [0, 1), got {args.range_ratio}")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests: must be >= 0, got {args.warmup_requests}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout: must be > 0, got {args.request_timeout}")
    if not args.label or not all(c.isalnum() or c in "._-" for c in args.label):
        raise ValueError(f"--label: letters, digits, '.', '_' and '-' only, got {args.label!r}")
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        raise ValueError(f"--goodput: {e}") from None
    adapters = tuple(a.strip() for a in args.lora_adapters.split(",")) if args.lora_adapters.strip() else ()
    cfgs = [LoadConfig(args.base_url, args.model, args.endpoint, rate, args.burstiness, args.concurrency,
                       args.duration, args.request_timeout, True, args.seed + i, not args.no_progress,
                       adapters, args.lora_pick, args.conversation_rate, args.think_time)
            for i, rate in enumerate(_rates(args))]
    if args.duration and math.isinf(cfgs[0].request_rate) and not args.concurrency:
        raise ValueError(
            "--duration: needs --request-rate, --sweep-rates or --concurrency (else nothing bounds the load)"
        )
    return cfgs, slos


def make_specs(args, tokenizer, n: int, seed: int) -> list[dataset.RequestSpec]:
    if args.multi_turn is not None:
        return dataset.multi_turn_requests(tokenizer, *args.multi_turn, args.input_len, args.output_len, seed)
    if args.dataset:
        return dataset.file_requests(args.dataset, tokenizer, n, args.output_len, seed)
    return dataset.random_requests(tokenizer, n, args.input_len, args.output_len, args.range_ratio, seed)


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def rate_name(rate: float | None) -> str:
    return "inf" if rate is None or math.isinf(rate) else f"{rate:g}"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfgs, slos = configs_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        tokenizer, _ = serve_tokenizer.resolve(args.tokenizer, args.base_url, args.model,
                                               say=lambda msg: print(f"pdserve bench serve: {msg}", file=sys.stderr))
    except serve_tokenizer.TokenizerNotFound as e:
        parser.error(f"--tokenizer: cannot load a tokenizer ({e}); pass --tokenizer PATH (the model's directory)")
    plots = bool(args.out) and not args.no_plots
    unplotted = False  # plots wanted, matplotlib missing: said again at the end, where it is seen
    if plots:
        from pdserve.bench import plot

        if not plot.available():
            print(f"pdserve bench serve: --out: writing JSON only; {plot.missing_for(args.out)}", file=sys.stderr)
            plots = False
            unplotted = True
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.warmup_requests:
        warm = make_specs(args, tokenizer, args.warmup_requests, args.seed + 10_000)
        _run(run_load(LoadConfig(args.base_url, args.model, args.endpoint, concurrency=args.concurrency,
                                 progress=False, lora_adapters=cfgs[0].lora_adapters,
                                 lora_pick=cfgs[0].lora_pick), warm))
    records = []
    for cfg in cfgs:
        try:
            specs = make_specs(
                args, tokenizer, prompts_needed(cfg, args.num_requests or (None if args.duration else 200)), cfg.seed
            )
        except ValueError as e:
            parser.error(f"--{'dataset' if args.dataset else 'input-len'}: {e}")
        before = server_metrics.scrape_all(args.metrics_url)
        results, duration = _run(run_load(cfg, specs))
        deltas = server_metrics.delta(before, server_metrics.scrape_all(args.metrics_url))
        summary = summarize(results, duration, slos)
        if args.endpoint == "completions":  # chat templates add tokens the prompt length does not count
            summary["prompt_len_mismatches"] = sum(1 for r in results if r.server_prompt_tokens is not None
                                                   and r.server_prompt_tokens != r.prompt_len)
        pace = f"{rate_name(cfg.request_rate)} req/s"
        if not math.isinf(cfg.conversation_rate) or cfg.think_time_s:
            pace = f"{rate_name(cfg.conversation_rate)} conversations/s, {cfg.think_time_s:g} s think time"
        print(format_summary(summary, f"{args.label} @ {pace}"), flush=True)
        record = run_record(Workload.from_args(args), cfg, summary, results, deltas)
        records.append(record)
        if args.out:
            path = Path(args.out) / f"{args.label}_rate-{rate_name(cfg.request_rate)}.json"
            path.write_text(json.dumps(record))
    if plots:
        for path in plot.plot_runs(records, args.out):
            print(f"wrote {path}")
    if unplotted:
        print(f"pdserve bench serve: no plots: {plot.missing_for(args.out)}", file=sys.stderr)
    return 0 if any(r["summary"]["completed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
