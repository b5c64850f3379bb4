"""A simulated P/D cluster for the planner simulation (bench/planner_sim.py): worker capacity
curves taken from the GPU measurements in docs/, a day-long trace, and a fluid queue model.

Capacity (Llama-3.1-8B, bf16, one H100 per worker, pdserve's engine), from
docs/disagg-gpu-results.md and docs/engine-gpu-results.md:

- prefill: 3000 prompt tokens in 77.8 ms at 1 req/s (the prefill worker's TTFT with no queue):
  ~38.5k prompt tokens/s per worker (`PREFILL_TPS`);
- decode step: 6.35 ms at batch 1 (CUDA graphs, engine-gpu-results), and ITL p50 10.2 ms with
  ~14 sequences decoding (pd at 7 req/s of 3000/200, 200 tokens each at ~10 ms: 7 × 2 s):
  a step costs `DECODE_STEP_S + DECODE_PER_SEQ_S × batch` (0.27 ms per ~3k-token sequence);
- decode KV: 26829 blocks × 16 tokens per worker (gpu-perf-results.md): at most
  `KV_TOKENS / (prompt + output)` sequences at once.

The model is fluid (rates per step, not single requests): a queue is a backlog of tokens, its
wait is backlog / capacity, plus an M/D/1-like wait `s·ρ/(2(1−ρ))` scaled to the percentile for
random arrivals below saturation. That is enough to rank policies by SLO attainment and
GPU-hours; it does not reproduce a single request's latency. Named limitations are in
docs/autoscaling.md.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PREFILL_TPS = 38_500.0  # prompt tokens/s per prefill worker, alone
DECODE_STEP_S = 0.00635  # a decode step at batch 1
DECODE_PER_SEQ_S = 0.00027  # each more sequence in the batch (~3k-token context)
KV_TOKENS = 26_829 * 16
STARTUP_S = 90.0  # a new worker: pod start, weights from the node cache, CUDA graphs
PERCENTILE_FACTOR = math.log(10)  # exponential tail: p90 of a wait is ln(10) × its mean


@dataclass(frozen=True)
class Mix:
    rate: float  # requests/s
    prompt: float  # tokens
    output: float  # tokens


# The day's phases (hour, requests/s, prompt, output), interpolated linearly between them: batch
# summarisation at night (long prompts, short answers), chat by day, long agentic answers in the
# evening. The prefill:decode ratio that fits moves from ~3:1 to ~1:9 over the day.
PHASES = ((0, 90, 8000, 150), (5, 60, 8000, 150), (8, 250, 2500, 300), (14, 420, 2000, 300),
          (18, 320, 1200, 500), (21, 330, 1000, 600), (24, 90, 8000, 150))


def base_mix(t_s: float) -> Mix:
    h = (t_s / 3600.0) % 24
    for (h0, r0, p0, o0), (h1, r1, p1, o1) in zip(PHASES, PHASES[1:]):
        if h0 <= h <= h1:
            f = (h - h0) / (h1 - h0)
            return Mix(r0 + f * (r1 - r0), p0 + f * (p1 - p0), o0 + f * (o1 - o0))
    raise AssertionError(h)


@dataclass(frozen=True)
class Burst:
    start_s: float
    length_s: float
    factor: float


def bursts(seed: int, day_s: float = 86400.0, count: int = 10) -> list[Burst]:
    rng = random.Random(seed)
    return sorted((Burst(rng.uniform(0, day_s - 1800), rng.uniform(300, 1200), rng.uniform(1.3, 1.8))
                   for _ in range(count)), key=lambda b: b.start_s)


def mix_at(t_s: float, burst_list: list[Burst]) -> Mix:
    m = base_mix(t_s)
    factor = 1.0
    for b in burst_list:
        if b.start_s <= t_s < b.start_s + b.length_s:
            factor = max(factor, b.factor)
    return Mix(m.rate * factor, m.prompt, m.output)


@dataclass
class Pool:
    """One role's workers: ready ones and ones still starting (each with its ready time)."""

    ready: int
    starting: list[float]

    def set_target(self, n: int, now: float) -> None:
        total = self.ready + len(self.starting)
        if n > total:
            self.starting += [now + STARTUP_S] * (n - total)
        elif n < total:
            cut = total - n
            drop = min(cut, len(self.starting))  # a starting pod is cancelled first
            self.starting = self.starting[:len(self.starting) - drop]
            self.ready -= cut - drop

    def advance(self, now: float) -> None:
        done = [s for s in self.starting if s <= now]
        self.ready += len(done)
        self.starting = [s for s in self.starting if s > now]

    @property
    def allocated(self) -> int:
        return self.ready + len(self.starting)


@dataclass
class StepResult:
    ttft: float  # seconds, at the percentile
    itl: float  # seconds
    prefill_tps: float  # prompt tokens/s done
    decode_tps: float  # generated tokens/s done
    prefill_waiting: float  # requests queued for prefill
    decode_waiting: float  # requests queued for a decode slot


class Cluster:
    """The fluid state across steps: prefill and decode backlogs (tokens)."""

    def __init__(self) -> None:
        self.prefill_backlog = 0.0
        self.decode_backlog = 0.0

    def step(self, mix: Mix, prefill_workers: int, decode_workers: int, dt: float) -> StepResult:
        demand_p = mix.rate * mix.prompt
        demand_d = mix.rate * mix.output
        # Prefill: a pool of `prefill_workers` at PREFILL_TPS each; with none, decode workers
        # prefill locally (the router's fallback), at the same rate but taking decode time.
        cap_p = prefill_workers * PREFILL_TPS
        local = prefill_workers == 0
        if local:
            cap_p = decode_workers * PREFILL_TPS * 0.5  # half their time left to decode
        service = mix.prompt / PREFILL_TPS
        self.prefill_backlog = max(0.0, self.prefill_backlog + (demand_p - cap_p) * dt)
        done_p = min(demand_p + self.prefill_backlog / dt, cap_p) if cap_p else 0.0
        rho = min(demand_p / cap_p, 0.99) if cap_p else 0.99
        queue_wait = self.prefill_backlog / cap_p if cap_p else 3600.0
        ttft = service + queue_wait + PERCENTILE_FACTOR * service * rho / (2 * (1 - rho))

        # Decode: per worker, the batch b that serves its share d: d = b / (a + k·b).
        a, k = DECODE_STEP_S, DECODE_PER_SEQ_S
        max_batch = KV_TOKENS / (mix.prompt + mix.output)
        per_worker_max = max_batch / (a + k * max_batch)
        cap_d = decode_workers * per_worker_max * (0.5 if local else 1.0)
        self.decode_backlog = max(0.0, self.decode_backlog + (demand_d - cap_d) * dt)
        if decode_workers == 0:
            return StepResult(ttft + 3600.0, 1.0, done_p, 0.0, self.prefill_backlog / mix.prompt, 0.0)
        d = min(demand_d, cap_d) / decode_workers / (0.5 if local else 1.0)
        batch = min(d * a / max(1e-9, 1 - d * k), max_batch)
        itl = a + k * batch
        if local:  # prefill chunks share the steps: a long prompt stalls the batch
            itl += mix.prompt / PREFILL_TPS / max(1.0, mix.output) * 4
        # A request that waits for a decode slot has its first token already (the prefill sent
        # it): the wait is a gap in its stream, so it is charged to the decode side, spread over
        # its output tokens (time per output token), not to TTFT.
        decode_wait = self.decode_backlog / cap_d if cap_d else 3600.0
        done_d = min(demand_d + self.decode_backlog / dt, cap_d)
        return StepResult(ttft, itl + decode_wait / max(1.0, mix.output), done_p, done_d,
                          self.prefill_backlog / mix.prompt, self.decode_backlog / mix.output)
