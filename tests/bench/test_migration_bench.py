"""bench/migration.py: a short run of the harness on real processes (router, a prefill and three
decode workers, tiny model): the decode worker serving chosen streams is SIGKILLed until three
streams were hit; no request fails and every answer equals its twin from a worker never killed."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import migration

pytestmark = pytest.mark.slow
# Not greedy completions with logprobs: a continuation's `text_offset` can be one off there on the
# word tokenizer (docs/results/router/2026-12-03-cpu-migration-kills.md), an open bug.
SHAPES = [s for s in migration.SHAPES if s != "greedy-logprobs"]


def test_streams_of_killed_decode_workers_fail_nothing_and_equal_their_twins(tmp_path):
    rc = migration.main(["--out", str(tmp_path), "--hits", "3", "--concurrency", "6", "--prefill", "1", "--decode", "3",
                         "--prompt-tokens", "16", "--max-tokens", "128", "--device", "cpu", "--kv-transfer", "tcp",
                         "--no-restart", "--budget-s", "120", "--twins", "20", "--shapes", ",".join(SHAPES)])
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["failed"] == [] and s["diffs"] == []
    assert s["equal"] == s["checked"] >= s["hits"] + min(20, s["requests"] - s["hits"])
    assert s["hits"] >= 2 and rc == 0  # two kills at most (--no-restart, 3 decode workers)
    # The router moved streams (a hit whose finish was out already ends without a move).
    assert 0 < sum(s["router"]["migrations"].values()) == s["moved_in_router_log"] <= s["hits"]
    assert all(h["gap_s"] is not None and h["reprefill_s"] > 0 for h in s["per_hit"])
    assert "client-visible gap" in (tmp_path / "results.md").read_text()


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        migration.main(["--out", "x", "--kill-at", "0.9,0.1"])
    assert "--kill-at" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        migration.main(["--out", "x", "--decode", "1"])
    assert "--decode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        migration.main(["--out", "x", "--shapes", "greedy-logprobs,bogus"])
    assert "--shapes" in capsys.readouterr().err
