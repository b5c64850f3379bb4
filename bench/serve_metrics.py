"""Per-request results and the run summary of `pdserve bench serve`, with vLLM's meanings:

- TTFT: request sent -> first chunk with generated text.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); the summary is over requests.
- ITL: every gap between consecutive content chunks, pooled over all requests.
- E2E (vLLM's E2EL): request sent -> end of the stream.
- Throughputs divide by the run's duration (first send -> last completion); output tokens are
  the server's `usage.completion_tokens`.
- Goodput: completed requests per second that meet every given SLO (`--goodput`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")  # itl: the request's largest inter-token gap


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0  # perf_counter when sent
    send_lag: float = 0.0  # how late the send was against its arrival time (load generator lag)
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0  # usage.completion_tokens (or content chunks if no usage came)
    server_prompt_tokens: int | None = None
    error: str | None = None  # the error's type; None = success
    model: str | None = None  # what the request named (the base, or one of --lora-adapters)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_goodput(items: list[str]) -> dict[str, float]:
    """['ttft:2000', 'itl:25'] -> {'ttft': 2.0, 'itl': 0.025} (seconds). Raises ValueError."""
    slos = {}
    for item in items:
        key, sep, ms = item.partition(":")
        key = "e2e" if key == "e2el" else key
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"{item!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            value = float(ms)
        except ValueError:
            raise ValueError(f"{item!r}: {ms!r} is not a number of milliseconds") from None
        if not value > 0:
            raise ValueError(f"{item!r}: the SLO must be > 0 ms")
        slos[key] = value / 1000
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "itl": max(r.itls, default=0.0), "e2e": r.e2e}
    return r.ok and all(got[k] <= v for k, v in slos.items())


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "std": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    s = sorted(values)
    out = {"mean": statistics.fmean(s), "std": statistics.pstdev(s)}
    for p in PERCENTILES:  # linear interpolation, as numpy.percentile (what vLLM uses)
        k = (len(s) - 1) * p / 100
        lo = math.floor(k)
        hi = min(lo + 1, len(s) - 1)
        out[f"p{p}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return out


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = sum(meets(r, slos) for r in ok) if slos else None
    d = max(duration_s, 1e-9)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / d,
        "output_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
        "request_goodput": good / d if good is not None else None,
        "good_requests": good,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _stats([g for r in ok for g in r.itls]),
        "e2e_s": _stats([r.e2e for r in ok]),
        "send_lag_s": _stats([r.send_lag for r in results]),  # > 0: the generator fell behind its schedule
    }


def format_summary(s: dict, title: str) -> str:
    """A table shaped like vLLM's benchmark result block."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(name, value, fmt="{:<40} {:>10}"):
        lines.append(fmt.format(name, value))

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    for kind, n in sorted(s["errors"].items()):
        row(f"  {kind}:", n)
    row("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    if s["request_goodput"] is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["goodput_slos_ms"].items())
        row("Request goodput (req/s):", f"{s['request_goodput']:.2f}")
        lines.append(f"  (SLO per request: {slo})")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for key, name in (("ttft_s", "Time to First Token"), ("tpot_s", "Time per Output Token (excl. 1st token)"),
                      ("itl_s", "Inter-token Latency"), ("e2e_s", "End-to-end Latency")):
        lines.append(f"{' ' + name + ' ':-^{w}}")
        short = key.split("_")[0].upper()
        st = s[key]
        row(f"Mean {short} (ms):", f"{st['mean'] * 1000:.2f}")
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", f"{st[f'p{p}'] * 1000:.2f}")
    lines.append("-" * w)
    row("Send lag behind schedule P99 (ms):", f"{s['send_lag_s']['p99'] * 1000:.2f}")
    lines.append("=" * w)
    return "\n".join(lines)
