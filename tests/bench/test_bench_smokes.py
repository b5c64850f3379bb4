"""The GPU benches whose only runs are on a device machine (`bench/engine.py` behind
tools/gpu/offline_ab.sh and small_models.sh, `bench/lora.py` behind tools/gpu/lora.sh), run here
end to end in their `--smoke` form (tiny random models on CPU), in a process of their own as on
the device: a harness break shows in CI, not as a device call's lost minutes."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("bench, row", [
    ("engine", "| pdserve (4 prompts) |"),  # the offline rows, after every bs=1 row
    ("lora", "| LoRA | 8 |"),  # the last adapter count of the table
])
def test_smoke_run_writes_its_table(tmp_path, bench, row):
    out = tmp_path / f"{bench}.md"
    proc = subprocess.run([sys.executable, "-m", f"pdserve.bench.{bench}", "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert row in out.read_text()
