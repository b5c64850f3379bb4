"""bench/migration.py: a short run of the harness on real processes (router, a prefill and two
decode workers, tiny model): the decode worker serving a chosen stream is SIGKILLed once; no
request fails and every answer equals its twin from a worker never killed. It proves the harness
end to end, every shape included; the measurement is docs/results/router/'s."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import migration

pytestmark = pytest.mark.slow


def test_streams_of_a_killed_decode_worker_fail_nothing_and_equal_their_twins(tmp_path):
    # One kill (--no-restart, 2 decode workers: the survivor and the prefill worker take its streams).
    # The chosen stream (one that runs to max_tokens) is killed with most of its answer still to come
    # (128 tokens, chosen before 50 %), so the router has something to move.
    rc = migration.main(["--out", str(tmp_path), "--hits", "1", "--concurrency", "4", "--prefill", "1", "--decode", "2",
                         "--prompt-tokens", "16", "--max-tokens", "128", "--kill-at", "0.2,0.5", "--device", "cpu",
                         "--kv-transfer", "tcp", "--no-restart", "--budget-s", "60", "--twins", "6"])
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["failed"] == [] and s["diffs"] == []
    assert s["equal"] == s["checked"] >= s["hits"] + min(6, s["requests"] - s["hits"])
    assert len(s["kills"]) == 1 and s["hits"] >= 1 and rc == 0
    # The router moved streams. Not bounded by the bench's hits: those are the victim's streams in its
    # /debug/kv snapshot just before the kill, and the router may hand the victim another stream in
    # between (then it moves one more than the bench counted); every answer is checked above either way.
    assert 0 < sum(s["router"]["migrations"].values()) == s["moved_in_router_log"] <= s["requests"]
    assert all(h["reprefill_s"] > 0 for h in s["per_hit"])
    # The chosen stream had events before its kill and after it: its client-visible gap is measured. The
    # worker's other streams may have had none yet when it died (their gap is undefined, not measured).
    chosen = {k["chosen"] for k in s["kills"]}
    assert all(h["gap_s"] is not None for h in s["per_hit"] if h["rid"] in chosen)
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
