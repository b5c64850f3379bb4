"""bench/pd_async.py: the CPU smoke run starts every mode (real engines, TCP hand-off) and writes
one row each, every mode's greedy tokens equal to the synchronous aggregated engine's."""

from __future__ import annotations

from pdserve.bench import pd_async


def test_smoke_run_writes_a_row_per_mode(tmp_path):
    out = tmp_path / "pd_async.md"
    assert pd_async.main(["--smoke", "--out", str(out)]) == 0
    rows = [line.strip("| ").split(" | ") for line in out.read_text().splitlines()
            if line.startswith(("| agg", "| pd"))]
    assert [r[0] for r in rows] == ["agg-sync", "pd-sync (tcp)", "pd-async (tcp)", "agg-async"]
    assert [r[1] for r in rows] == ["no", "no", "yes", "yes"]  # the flag took effect where asked
    assert [r[5] for r in rows[1:]] == ["yes"] * 3
    assert all(r[3] for r in rows[1:3])  # a first gap for the P/D rows


def test_bad_arguments_are_named(capsys):
    assert pd_async.main(["--smoke", "--modes", "agg-sync,bogus"]) == 2
    assert "--modes" in capsys.readouterr().err
