"""tools/gpu/offline_steps.py on CPU: every timed step is counted with the rows it really ran, so
the device run's buckets add up (a tiny Llama, a few prompts; timings are not checked)."""

from __future__ import annotations

from tools.gpu import offline_steps


def test_steps_carry_every_row_the_engine_ran(capsys):
    prompts, prompt_len, max_tokens = 3, 16, 3
    runs = offline_steps.main(["--device", "cpu", "--model", "tiny-llama", "--prompts", str(prompts),
                               "--prompt-len", str(prompt_len), "--max-tokens", str(max_tokens), "--runs", "2",
                               # Every function in the host table: the step's rank by own time moves with
                               # the machine's load (17th of 20 on a quiet CI machine).
                               "--host-functions", "10000"])
    assert len(runs) == 2
    for steps in runs:
        # Each prompt's tokens once (prefill), then one row per request for each later token.
        assert sum(rows for rows, _ in steps) == prompts * prompt_len + prompts * (max_tokens - 1)
        assert all(sec > 0 for _, sec in steps)
    out = capsys.readouterr().out
    assert out.count("| rows launched |") == 2 and "process CPU" in out and "host probe" in out
    assert "under cProfile" in out and "| step (" in out  # the host profile names the engine's step


def test_host_probe_times_its_fixed_work():
    from pdserve.bench.host_probe import _work, host_probe_us

    # The same work every call: a row's block list holds 1 entry for steps 0-14, 2 for 15-30, 3 at 31.
    assert _work(n=4, steps=32) == 4 * (15 * 1 + 16 * 2 + 1 * 3)
    assert host_probe_us(repeats=3) > 0
