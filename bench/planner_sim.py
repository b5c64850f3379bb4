"""`pdserve bench planner-sim [--out DIR]`: the planner's own code (operator/planner.py)
driving a simulated cluster of up to 128 GPUs through a day, against fixed P:D ratios and one
HPA per role. Prints one table (SLO attainment, GPU-hours) and, with --out, writes PNG figures
and the table as JSON. No GPU needed; the cluster model is bench/cluster_model.py.

Policies, all on the same trace (same seed) and the same 128-GPU budget:
- planner: `decide()` every 15 s on snapshots made from the simulated metrics (token rates the
  workers did, TTFT and ITL at p90), seeded with the docs' per-worker capacities at the SLO;
- fixed 1:1, 1:3, 3:1: all 128 GPUs held all day in that prefill:decode split;
- hpa: one HorizontalPodAutoscaler per role on the chart's default metric
  (vllm:num_requests_waiting per pod, target 4), Kubernetes' algorithm: every 15 s,
  desired = ceil(current × metric / target) outside a 10% tolerance, up by at most 100% or 4 pods
  per period, scale-down stabilised over 300 s, within 1..64 per role.
SLO (docs/disagg-gpu-results.md): TTFT p90 ≤ 2 s and ITL p90 ≤ 25 ms; attainment is the share
of requests that arrive in steps meeting both.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.cluster_model import (DECODE_PER_SEQ_S, DECODE_STEP_S, KV_TOKENS, PREFILL_TPS, Cluster, Pool,
                                          bursts, mix_at)
from pdserve.bench.report import markdown_table
from pdserve.operator.planner import PlannerConfig, PlannerState, RoleBounds, RoleSample, Snapshot, decide

DAY_S = 86400.0
STEP_S = 15.0
BUDGET = 128
TTFT_S, ITL_S = 2.0, 0.025


@dataclass
class Trace:
    t: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)


def decode_capacity_at_slo(prompt: float, output: float) -> float:
    """Generated tokens/s one decode worker sustains with ITL at the target (cluster_model's curve)."""
    batch = min((ITL_S - DECODE_STEP_S) / DECODE_PER_SEQ_S, KV_TOKENS / (prompt + output))
    return batch / (DECODE_STEP_S + DECODE_PER_SEQ_S * batch)


def warm_start() -> tuple[int, int]:
    """The adaptive policies start the day sized for its first minute (as after a day before)."""
    m = mix_at(0.0, [])
    return (math.ceil(m.rate * m.prompt / (PREFILL_TPS * 0.8)),
            math.ceil(m.rate * m.output / (decode_capacity_at_slo(m.prompt, m.output) * 0.8)))


class PlannerPolicy:
    name = "planner"

    def __init__(self) -> None:
        self.config = PlannerConfig(
            ttft_s=TTFT_S,
            itl_s=ITL_S,
            percentile=0.9,
            prefill=RoleBounds(1, BUDGET),
            decode=RoleBounds(1, BUDGET),
            gpu_budget=BUDGET,
            prefill_capacity_tps=PREFILL_TPS * 0.9,
            decode_capacity_tps=decode_capacity_at_slo(3000, 200),
            scale_up_cooldown_s=30,
            scale_down_window_s=300,
            max_scale_down_step=4,
            target_utilization=0.8,
        )
        self.state = PlannerState()

    def __call__(self, now: float, p: Pool, d: Pool, last) -> tuple[int, int]:
        if last is None:
            return warm_start()
        snap = Snapshot(now, RoleSample(p.allocated, p.ready, last.prefill_tps, last.ttft, last.prefill_waiting),
                        RoleSample(d.allocated, d.ready, last.decode_tps, last.itl, last.decode_waiting))
        decision, self.state = decide(self.config, self.state, snap)
        return decision.prefill, decision.decode


class FixedPolicy:
    def __init__(self, prefill: int, decode: int) -> None:
        self.name = f"fixed {prefill}:{decode}"
        self.split = (prefill, decode)

    def __call__(self, now, p, d, last) -> tuple[int, int]:
        return self.split


class HPAPolicy:
    """Kubernetes' HPA algorithm, one per role, on waiting requests per pod."""

    name = "hpa (per role)"
    TARGET, TOLERANCE, WINDOW_S, LO, HI = 4.0, 0.1, 300.0, 1, 64

    def __init__(self) -> None:
        self.history: dict[str, list[tuple[float, int]]] = {"p": [], "d": []}

    def _one(self, key: str, now: float, pool: Pool, waiting: float) -> int:
        current = max(pool.allocated, 1)
        ratio = (waiting / max(pool.ready, 1)) / self.TARGET
        want = current if abs(ratio - 1) <= self.TOLERANCE else math.ceil(current * ratio)
        want = min(want, max(2 * current, current + 4))  # the default scale-up policy: 100% or 4 pods per 15 s
        want = min(max(want, self.LO), self.HI)
        hist = [(t, n) for t, n in self.history[key] if now - t < self.WINDOW_S] + [(now, want)]
        self.history[key] = hist
        if want < current:  # scale-down stabilisation: the highest recommendation of the window
            want = min(current, max(n for _, n in hist))
        return want

    def __call__(self, now, p, d, last) -> tuple[int, int]:
        if last is None:
            return warm_start()
        return self._one("p", now, p, last.prefill_waiting), self._one("d", now, d, last.decode_waiting)


def simulate(policy, seed: int = 7) -> Trace:
    burst_list = bursts(seed)
    cluster, p, d = Cluster(), Pool(0, []), Pool(0, [])
    trace, last, now = Trace(), None, 0.0
    first = policy(now, p, d, None)
    p.ready, d.ready = first  # the day starts warm
    while now < DAY_S:
        mix = mix_at(now, burst_list)
        want_p, want_d = policy(now, p, d, last) if last is not None else first
        p.set_target(want_p, now)
        d.set_target(want_d, now)
        p.advance(now)
        d.advance(now)
        last = cluster.step(mix, p.ready, d.ready, STEP_S)
        trace.t.append(now)
        trace.rate.append(mix.rate)
        trace.prefill.append(p.allocated)
        trace.decode.append(d.allocated)
        trace.ttft.append(last.ttft)
        trace.itl.append(last.itl)
        trace.ok.append(last.ttft <= TTFT_S and last.itl <= ITL_S)
        now += STEP_S
    return trace


def summary(name: str, tr: Trace) -> dict:
    weight = sum(tr.rate)
    return {"policy": name,
            "slo_attainment": sum(r for r, ok in zip(tr.rate, tr.ok) if ok) / weight,
            "gpu_hours": sum(p + d for p, d in zip(tr.prefill, tr.decode)) * STEP_S / 3600,
            "peak_gpus": max(p + d for p, d in zip(tr.prefill, tr.decode)),
            "ttft_over_target_minutes": sum(STEP_S for x in tr.ttft if x > TTFT_S) / 60,
            "itl_over_target_minutes": sum(STEP_S for x in tr.itl if x > ITL_S) / 60}


def policies() -> list:
    half = BUDGET // 4
    return [PlannerPolicy(), FixedPolicy(BUDGET // 2, BUDGET // 2), FixedPolicy(half, 3 * half),
            FixedPolicy(3 * half, half), HPAPolicy()]


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["policy", "SLO attainment", "GPU-hours", "peak GPUs", "TTFT over target (min)", "ITL over target (min)"],
        [[r["policy"], f"{100 * r['slo_attainment']:.1f}%", f"{r['gpu_hours']:.0f}", f"{r['peak_gpus']}",
          f"{r['ttft_over_target_minutes']:.0f}", f"{r['itl_over_target_minutes']:.0f}"] for r in rows],
        right={1, 2, 3, 4, 5})


def plot(traces: dict[str, Trace], rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [t / 3600 for t in traces["planner"].t]
    burst_list = bursts(7)
    mixes = [mix_at(t, burst_list) for t in traces["planner"].t]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(hours, [m.rate for m in mixes], color="k")
    axes[0].set_ylabel("requests/s")
    ax2 = axes[0].twinx()
    ax2.plot(hours, [m.prompt / m.output for m in mixes], color="tab:purple", alpha=0.6)
    ax2.set_ylabel("prompt/output tokens", color="tab:purple")
    axes[0].set_title("the trace: diurnal load with bursts; the prompt/output mix moves through the day")
    for ax, name in ((axes[1], "planner"), (axes[2], "hpa (per role)")):
        tr = traces[name]
        ax.plot(hours, tr.prefill, color="tab:blue", label="prefill", linewidth=0.9)
        ax.plot(hours, tr.decode, color="tab:orange", label="decode", linewidth=0.9)
        ax.set_ylabel("workers (GPUs)")
        ax.legend(fontsize=8, loc="upper left")
        ax.set_title(f"replicas per role: {name}")
    for name, tr in traces.items():
        by_hour: dict[int, list[tuple[float, bool]]] = {}
        for t, r, ok in zip(tr.t, tr.rate, tr.ok):
            by_hour.setdefault(int(t // 3600), []).append((r, ok))
        xs = sorted(by_hour)
        ys = [100 * sum(r for r, ok in by_hour[h] if ok) / sum(r for r, _ in by_hour[h]) for h in xs]
        axes[3].plot([h + 0.5 for h in xs], ys, marker="o", markersize=3, label=name, linewidth=1)
    axes[3].set_ylabel("SLO attainment (%)")
    axes[3].set_xlabel("hour of day")
    axes[3].set_title("requests meeting TTFT p90 <= 2 s and ITL p90 <= 25 ms, per hour")
    axes[3].legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "planner_day.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        ax.scatter(r["gpu_hours"], 100 * r["slo_attainment"], s=60)
        ax.annotate(r["policy"], (r["gpu_hours"], 100 * r["slo_attainment"]), textcoords="offset points",
                    xytext=(6, 4), fontsize=9)
    ax.set_xlabel("GPU-hours over the day")
    ax.set_ylabel("SLO attainment (% of requests)")
    ax.set_title("same trace, same 128-GPU budget")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "planner_tradeoff.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve.bench.planner_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for planner_day.png, planner_tradeoff.png, planner_sim.json")
    parser.add_argument("--seed", type=int, default=7, help="the bursts' random seed")
    args = parser.parse_args(argv)
    traces, rows = {}, []
    for policy in policies():
        traces[policy.name] = simulate(policy, args.seed)
        rows.append(summary(policy.name, traces[policy.name]))
    print(f"simulated day: {DAY_S / 3600:.0f} h in {STEP_S:g} s steps, budget {BUDGET} GPUs, "
          f"SLO TTFT p90 <= {TTFT_S:g} s and ITL p90 <= {ITL_S * 1000:g} ms (Llama-3.1-8B on H100 curves, docs/)")
    print(table(rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "planner_sim.json").write_text(json.dumps({"seed": args.seed, "rows": rows}, indent=1) + "\n")
        plot(traces, rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
