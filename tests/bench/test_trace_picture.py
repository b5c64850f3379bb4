"""tools/trace_picture.py on the committed trace (docs/results/tracing/): every span in its tree
order under the router's, each in the lane of the process it ran in, drawn to a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from tools import trace_picture

TRACE = Path(__file__).resolve().parents[2] / "docs" / "results" / "tracing" / "2026-12-02-cpu-trace.json"


def test_the_committed_trace_is_drawn_in_tree_order_and_lanes(tmp_path):
    spans = json.loads(TRACE.read_text())
    rows = trace_picture.tree_order(spans)
    assert len(rows) == len(spans) and rows[0][0]["name"] == "router completions" and rows[0][1] == 0
    by_id = {s["span_id"]: s for s in spans}
    depth = {s["span_id"]: d for s, d in rows}
    for s, d in rows[1:]:
        assert depth[s["parent_id"]] == d - 1  # every span right under its parent's depth
    lanes = {(s["name"], trace_picture.lane(s, by_id)) for s in spans}
    assert {("prefill call", "router"), ("worker prefill", "prefill worker"), ("prefill", "prefill worker"),
            ("worker decode", "decode worker"), ("kv transfer", "KV transfer"), ("decode", "decode worker")} <= lanes
    png = tmp_path / "trace.png"
    trace_picture.draw(spans, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
