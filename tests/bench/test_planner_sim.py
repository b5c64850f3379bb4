"""The planner simulation (bench/planner_sim.py): the planner's own code on a simulated day. The
outcome is deterministic (seeded trace, no clocks), so its ranking is a regression check."""

from __future__ import annotations

import json

from pdserve.bench.cluster_model import Pool
from pdserve.bench.planner_sim import BUDGET, FixedPolicy, PlannerPolicy, main, simulate, summary


def test_the_planner_beats_the_fixed_splits_on_the_day():
    planner = summary("planner", simulate(PlannerPolicy()))
    fixed = [summary(p.name, simulate(p)) for p in (FixedPolicy(64, 64), FixedPolicy(96, 32))]
    for f in fixed:
        assert planner["slo_attainment"] > f["slo_attainment"]
        assert planner["gpu_hours"] < f["gpu_hours"]
    assert planner["peak_gpus"] <= BUDGET  # the GPU budget holds at every step


def test_a_pool_cancels_starting_workers_first():
    pool = Pool(ready=2, starting=[])
    pool.set_target(4, now=0.0)
    assert (pool.ready, len(pool.starting)) == (2, 2)
    pool.set_target(3, now=10.0)
    assert (pool.ready, len(pool.starting)) == (2, 1)
    pool.advance(1000.0)
    assert (pool.ready, pool.starting) == (3, [])


def test_the_command_writes_the_table_and_figures(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    assert "| planner |" in capsys.readouterr().out
    rows = json.loads((tmp_path / "planner_sim.json").read_text())["rows"]
    assert [r["policy"] for r in rows][:2] == ["planner", "fixed 64:64"]
    assert (tmp_path / "planner_day.png").stat().st_size > 10_000
    assert (tmp_path / "planner_tradeoff.png").stat().st_size > 10_000
