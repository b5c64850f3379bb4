"""bench/step_overlap.py: the CPU smoke run measures both engines and writes one row per mode."""

from __future__ import annotations

from pdserve.bench import step_overlap


def test_smoke_run_writes_a_row_per_mode(tmp_path):
    out = tmp_path / "overlap.md"
    assert step_overlap.main(["--smoke", "--steps", "3", "--batch", "2", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny-llama")]
    assert [r.split(" | ")[2] for r in rows] == ["synchronous (baseline)", "async scheduling"]
    for r in rows:
        wall, device = (float(v) for v in r.split(" | ")[3:5])
        assert wall > 0 and device > 0
    assert rows[1].rstrip(" |").split(" | ")[7] == "yes"


def test_bad_arguments_are_named(capsys):
    assert step_overlap.main(["--smoke", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
