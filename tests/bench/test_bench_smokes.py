"""The GPU benches whose only other runs are on a device machine (`bench/engine.py` behind
tools/gpu/offline_ab.sh and small_models.sh, `bench/lora.py` behind tools/gpu/lora.sh,
`bench/handoff.py` behind tools/gpu/handoff.sh and tcp_io.sh), run here end to end in their
`--smoke` form (tiny random models on CPU; the hand-off's with real workers, router and load
generator over TCP), in a process of their own as on the device: a harness break shows in CI,
not as a device call's lost minutes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def smoke(tmp_path, bench: str, out, timeout: float) -> None:
    """`python -m pdserve.bench.<bench> --smoke --out <out>`, which must exit 0."""
    proc = subprocess.run([sys.executable, "-m", f"pdserve.bench.{bench}", "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("bench, row", [
    ("engine", "| pdserve (4 prompts) |"),  # the offline rows, after every bs=1 row
    ("lora", "| LoRA | 8 |"),  # the last adapter count of the table
])
def test_smoke_run_writes_its_table(tmp_path, bench, row):
    out = tmp_path / f"{bench}.md"
    smoke(tmp_path, bench, out, timeout=300)
    assert row in out.read_text()
    if bench == "engine":  # each offline row's note: the host probe around its timed run
        assert "host probe" in out.read_text()


def test_handoff_smoke_runs_every_stage_and_records_every_point(tmp_path):
    out = tmp_path / "out"
    smoke(tmp_path, "handoff", out, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == [], summary["skipped"]  # a stage that raised is listed here
    rows = summary["rows"]
    assert {r["stack"] for r in rows} == {"agg", "tcp-off", "tcp-on"}
    assert {r["kind"] for r in rows} == {"load", "sweep"}
    for r in rows:
        assert r["sent"] > 0 and r["failed"] == 0 and r["good"] > 0, r
    assert (out / "results.md").read_text().count("| P/D tcp, overlap on |") >= 2
