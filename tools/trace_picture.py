"""One disaggregated request's trace, drawn as a timeline (docs/tracing.md's picture).

    python tools/trace_picture.py --png docs/tracing-trace.png --spans docs/results/tracing/trace.json
        [--model PATH] [--input-len 512] [--output-len 32]
    python tools/trace_picture.py --png OUT.png --from-spans docs/results/tracing/trace.json   # redraw

Starts `pdserve up` (1 prefill + 1 decode worker and the router, CPU, KV over TCP) with
`--otlp-traces-endpoint` on all three, exporting to a real OTLP receiver (tools/otlp_capture.py),
sends one streamed completion with a W3C traceparent of its own, waits until the router's, both
workers' and the KV transfer's spans have arrived, keeps them (--spans, JSON) and draws them: one
bar per span in the trace's tree order, coloured by where it ran (router, prefill worker, KV
transfer, decode worker), on a time axis from the router's first moment. Without --model, the
default SmolLM2-135M-Instruct (its prefill and decode take visible time on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

import httpx

COLOURS = {"router": "#4C72B0", "prefill worker": "#DD8452", "KV transfer": "#55A868", "decode worker": "#8172B3"}
WANTED = {"router completions", "worker prefill", "worker decode", "kv transfer"}


def capture(args) -> list[dict]:
    from otlp_capture import ReceiverProcess
    from pdserve.bench import dataset
    from pdserve.bench.disagg import UpStack, scratch_dir

    if args.model is None:
        from pdserve.worker.models.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    work = scratch_dir("pdserve-trace-picture-")
    # Export at once rather than every 5 s: the picture waits for one trace only.
    os.environ.update({"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    spec = dataset.random_requests(dataset.load_tokenizer(args.model), 2, args.input_len, args.output_len, seed=3)
    with ReceiverProcess() as rx:
        flags = f"--otlp-traces-endpoint {rx.http_url}"
        stack = UpStack(args.model, 1, 1, work / "stack", True, transport="tcp", worker_args=flags, router_args=flags)
        stack.start()
        try:
            router = stack.children["router"]
            trace_id = ""
            for s in spec:  # the first warms the stack up; the second is the one drawn
                trace_id = secrets.token_hex(16)
                body = {"model": "llama", "prompt": s.prompt, "max_tokens": s.output_len, "stream": True,
                        "ignore_eos": True, "temperature": 0}
                headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
                with httpx.stream("POST", router + "/v1/completions", json=body, headers=headers, timeout=120) as r:
                    r.raise_for_status()
                    for _ in r.iter_lines():
                        pass
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                spans = [s for s in rx.spans() if s["trace_id"] == trace_id]
                if WANTED <= {s["name"] for s in spans}:
                    time.sleep(0.5)  # the router's root ends last; a sibling batch may still be on its way
                    return [s for s in rx.spans() if s["trace_id"] == trace_id]
                time.sleep(0.2)
            raise RuntimeError(f"trace {trace_id} incomplete after 30 s: {sorted({s['name'] for s in spans})}")
        finally:
            stack.stop()


def lane(span: dict, by_id: dict[str, dict]) -> str:
    """Where a span ran: the router, or the worker whose request span it is (or is under)."""
    if span["service"] == "pdserve-router":
        return "router"
    if span["name"] == "kv transfer":
        return "KV transfer"
    s = span
    while s is not None and s["name"] not in ("worker prefill", "worker decode"):
        s = by_id.get(s["parent_id"])
    return "prefill worker" if s is not None and s["name"] == "worker prefill" else "decode worker"


def tree_order(spans: list[dict]) -> list[tuple[dict, int]]:
    """(span, depth) depth-first from the root(s), children by start time."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    out = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x["start_ns"]):
            out.append((s, depth))
            walk(s["span_id"], depth + 1)

    walk("", 0)
    return out


def draw(spans: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_id = {s["span_id"]: s for s in spans}
    rows = tree_order(spans)
    t0 = min(s["start_ns"] for s in spans)
    end = max(s["end_ns"] for s in spans)
    total_ms = (end - t0) / 1e6
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.6))
    for i, (s, depth) in enumerate(rows):
        start, dur = (s["start_ns"] - t0) / 1e6, max((s["end_ns"] - s["start_ns"]) / 1e6, total_ms / 800)
        where = lane(s, by_id)
        ax.barh(i, dur, left=start, height=0.6, color=COLOURS[where], edgecolor="black" if s["error"] else "none")
        label = f"{s['name']}  {(s['end_ns'] - s['start_ns']) / 1e6:.1f} ms"
        if s["name"] == "kv transfer" and "pdserve.kv.bytes" in s["attributes"]:
            label += f"  ({s['attributes']['pdserve.kv.bytes'] / 1024:.0f} KiB)"
        inside = dur > total_ms * 0.45
        ax.text(start + (dur / 2 if inside else dur + total_ms * 0.005), i, label, va="center",
                ha="center" if inside else "left", fontsize=8, color="white" if inside else "black")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["  " * depth + s["name"] for s, depth in rows], fontsize=8, family="monospace")
    ax.invert_yaxis()
    ax.set_xlim(0, total_ms * 1.18)
    ax.set_xlabel("ms since the router received the request")
    root = rows[0][0]
    attrs = next((s["attributes"] for s, _ in rows if s["name"] == "worker decode"), {})
    ax.set_title(f"One request through router → prefill → decode (trace {root['trace_id'][:12]}…): "
                 f"{attrs.get('gen_ai.usage.prompt_tokens', '?')} prompt tokens, "
                 f"{attrs.get('gen_ai.usage.completion_tokens', '?')} generated", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--png", type=Path, required=True)
    p.add_argument("--spans", type=Path, help="where the captured spans go (JSON)")
    p.add_argument("--from-spans", type=Path, help="draw these spans instead of capturing a trace")
    p.add_argument("--model")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    args = p.parse_args(argv)
    if args.from_spans:
        spans = json.loads(args.from_spans.read_text())
    else:
        spans = capture(args)
        if args.spans:
            args.spans.parent.mkdir(parents=True, exist_ok=True)
            args.spans.write_text(json.dumps(sorted(spans, key=lambda s: s["start_ns"]), indent=1))
    draw(spans, args.png)
    print(f"{len(spans)} spans -> {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
