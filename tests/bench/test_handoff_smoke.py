"""bench/handoff.py end to end on CPU (`--smoke`: a tiny model, real workers, router and load
generator over TCP): every stage runs and every point records requests. Its GPU runs are made
on a device machine that this suite never sees, so this is where a harness break shows first."""

from __future__ import annotations

import json
import subprocess
import sys


def test_smoke_runs_every_stage_and_records_every_point(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pdserve.bench.handoff", "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == [], summary["skipped"]  # a stage that raised is listed here
    rows = summary["rows"]
    assert {r["stack"] for r in rows} == {"agg", "tcp-off", "tcp-on"}
    assert {r["kind"] for r in rows} == {"load", "sweep"}
    for r in rows:
        assert r["sent"] > 0 and r["failed"] == 0 and r["good"] > 0, r
    assert (out / "results.md").read_text().count("| P/D tcp, overlap on |") >= 2
