"""bench/block_churn.py: the smoke run writes both tables; the churned layout is seeded, and with
eviction slack it is a real allocation too."""

from __future__ import annotations

import pytest

from pdserve.bench import block_churn


def test_smoke_run_writes_both_tables(tmp_path):
    out = tmp_path / "churn.md"
    assert block_churn.main(["--smoke", "--out", str(out)]) == 0
    report = out.read_text()
    for needle in ("| cache blocks | pull blocks | pull MiB | eviction slack | runs per side |",
                   "| 2048 | 512 | 128 | 0 |", "| 2048 | 512 | 128 | 1 |", "every other block is free"):
        assert needle in report, needle


@pytest.mark.parametrize("slack", [0.0, 1.0])
def test_churned_blocks_are_seeded_distinct_and_in_range(slack):
    ids = block_churn.churned_blocks(1024, 256, seed=5, eviction_slack=slack)
    assert len(ids) == len(set(ids)) == 256 and all(0 <= b < 1024 for b in ids)
    assert ids == block_churn.churned_blocks(1024, 256, seed=5, eviction_slack=slack)


@pytest.mark.parametrize("argv", [["--cases", "100:80"], ["--cases", "x"], ["--slack", "-1"], ["--seeds", "0"]])
def test_bad_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        block_churn.main(argv)
