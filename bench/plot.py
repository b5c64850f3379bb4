"""`pdserve bench plot RUN.json|DIR ... --out DIR`: charts of `pdserve bench serve` runs.

Two PNGs: `latency_cdf.png` (TTFT, ITL and E2E distributions, one curve per run) and
`vs_rate.png` (output throughput, TTFT p99, ITL p99 and goodput against the request rate, one
curve per `--label`, so two setups land on one chart; rate inf is drawn one step right of the
largest finite rate, labelled "inf"). matplotlib is optional: `bench serve
--out` says so once and writes JSON alone; this command exits 2 naming the package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

MISSING = "plots need matplotlib, which is not installed (pip install matplotlib)"


def missing_for(out_dir: str | Path) -> str:
    """What `bench serve --out` says without matplotlib: how to get the plots of this run later."""
    return (f"plots need matplotlib, which is not installed: pip install matplotlib, then "
            f"`pdserve bench plot {out_dir} --out {out_dir}` draws them from the JSON written there")


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _rate(run: dict) -> float:
    return run["request_rate"] if run["request_rate"] is not None else float("inf")


def rate_axis(rates: list[float]) -> tuple[dict[float, float], list[tuple[float, str]]]:
    """x position and tick of each offered rate. Rate inf (everything at once) has no place on a
    numeric axis: it goes one step right of the largest finite rate, labelled "inf", so a sweep
    that ends with inf, or a run at inf alone, is drawn rather than left out."""
    finite = sorted({r for r in rates if r != float("inf")})
    pos = {r: r for r in finite}
    ticks = [(r, f"{r:g}") for r in finite]
    if float("inf") in rates:
        if not finite:
            top = 1.0
        elif len(finite) == 1:
            top = 2 * finite[0]
        else:
            top = finite[-1] + (finite[-1] - finite[-2])
        pos[float("inf")] = top
        ticks.append((top, "inf"))
    return pos, ticks


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(v * 1000 for v in values)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, linewidth=1.2)


def _save(plt, fig, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise (a sweep draws many)
    return path


def plot_runs(runs: list[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = sorted(runs, key=lambda r: (r["label"], _rate(r)))
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        ok = [q for q in run["requests"] if q["error"] is None]
        name = f"{run['label']} @ {run['request_rate'] or 'inf'}/s"
        _cdf(axes[0], [q["ttft"] for q in ok], name)
        _cdf(axes[1], [g for q in ok for g in q["itls"]], name)
        _cdf(axes[2], [q["e2e"] for q in ok], name)
    for ax, what in zip(axes, ("TTFT", "ITL", "E2E latency")):
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
    if axes[2].get_legend_handles_labels()[0]:  # no curve at all when every request failed
        axes[2].legend(fontsize=7, loc="lower right")
    paths.append(_save(plt, fig, title or "latency CDFs", out / "latency_cdf.png"))

    by_label = defaultdict(list)
    for run in runs:
        by_label[run["label"]].append(run)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = (("output tok/s", lambda s: s["output_throughput"]),
              ("TTFT p99 (ms)", lambda s: s["ttft_s"]["p99"] * 1000),
              ("ITL p99 (ms)", lambda s: s["itl_s"]["p99"] * 1000),
              ("request goodput (req/s)", lambda s: s["request_goodput"] if s["request_goodput"] is not None
               else s["request_throughput"]))
    pos, ticks = rate_axis([_rate(r) for r in runs])
    for label, group in by_label.items():
        xs = [pos[_rate(r)] for r in group]
        for ax, (_, value) in zip(axes, panels):
            ax.plot(xs, [value(r["summary"]) for r in group], marker="o", label=label)
    if any(_rate(r) == float("inf") for r in runs):  # what "all at once" came to
        for label, group in by_label.items():
            for r in group:
                if _rate(r) == float("inf"):
                    axes[0].annotate(f"{r['summary']['request_throughput']:.3g} req/s achieved",
                                     (pos[float("inf")], r["summary"]["output_throughput"]), fontsize=7,
                                     textcoords="offset points", xytext=(-4, 6), ha="right")
    slos = next((r["summary"]["goodput_slos_ms"] for r in runs if r["summary"]["goodput_slos_ms"]), {})
    for ax, (name, _) in zip(axes, panels):
        ax.set_xlabel("request rate (req/s; inf: all at once)" if pos.get(float("inf")) else "request rate (req/s)")
        ax.set_xticks([x for x, _ in ticks], [t for _, t in ticks])
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    if "ttft" in slos:
        axes[1].axhline(slos["ttft"], color="grey", linestyle="--", linewidth=1, label="SLO")
    if "itl" in slos:
        axes[2].axhline(slos["itl"], color="grey", linestyle="--", linewidth=1, label="SLO")
    if slos:
        axes[3].set_title("per request: " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items())
                          + (" (itl: every gap)" if "itl" in slos else ""), fontsize=9)
    else:
        axes[3].set_ylabel("request throughput (req/s; no --goodput SLO)")
    axes[0].legend(fontsize=8)
    paths.append(_save(plt, fig, title or "against request rate", out / "vs_rate.png"))
    return paths


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for p in map(Path, paths):
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            run = json.loads(f.read_text())
            if "summary" not in run or "requests" not in run:
                raise ValueError(f"{f}: not a `pdserve bench serve` run (no summary/requests)")
            runs.append(run)
    if not runs:
        raise ValueError("no run JSON found")
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench plot", description=__doc__.splitlines()[0])
    p.add_argument(
        "runs", nargs="+", metavar="RUN.json|DIR", help="run files of `pdserve bench serve --out`, or folders of them"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="where the PNGs go")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    if not available():
        p.error(MISSING)
    try:
        runs = load_runs(args.runs)
    except (OSError, ValueError) as e:
        p.error(f"RUN.json: {e}")
    for path in plot_runs(runs, args.out, args.title):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
