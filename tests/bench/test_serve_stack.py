"""`pdserve bench serve` end to end: against the real local stack (1 prefill + 1 decode worker on a
tiny checkpoint, TCP KV transfer, the router; the children `pdserve up` runs), and against the mock
SSE server (bench/mock_sse_server.py) where a test needs a server that fails on purpose or counts
its concurrent streams, which real workers cannot be told to do. Every request is accounted for,
and the load generator's totals agree with what the servers' /metrics counted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from e2e.processes import ROOT, Stack
from pdserve.cli.stack import StackConfig
from tests.net import free_port
from tests.test_runtime_deps import dev_only_packages

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "pdserve.cli.main", "bench"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def stack(tiny_checkpoint, tmp_path_factory):
    config = StackConfig(prefill=1, decode=1, host="127.0.0.1", port=free_port(), device="cpu", kv_transfer="tcp",
                         # Workers on loopback pull KV from each other: allow it explicitly (the
                         # default allows no peer), whatever `pdserve up` adds by itself.
                         worker_args=("--kv-cache-memory", str(64 << 20), "--max-model-len", "512",
                                      "--kv-peer-allow", "127.0.0.1"))
    s = Stack(config, tiny_checkpoint("llama"), "tiny", tmp_path_factory.mktemp("bench-stack"))
    try:
        yield s.start_all()
    finally:
        s.stop_all()


@pytest.fixture(scope="module")
def mock():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mock_sse_server", "--port", str(port),
                             "--ttft-ms", "5", "--itl-ms", "1"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/stats", timeout=1).read()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "mock server did not start"
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


def test_sweep_against_local_stack_accounts_for_every_request(stack, tiny_checkpoint, tmp_path):
    router, prefill, decode = stack.url("router"), stack.url("prefill-0"), stack.url("decode-0")
    # No --tokenizer: the router's /v1/models names the checkpoint the workers loaded (its root).
    r = bench(
        "serve",
        "--base-url",
        router + "/v1",
        "--model",
        "tiny",
        "--input-len",
        "48",
        "--range-ratio",
        "0.25",
        "--output-len",
        "12",
        "--num-requests",
        "16",
        "--sweep-rates",
        "8,inf",
        "--concurrency",
        "4",
        "--goodput",
        "ttft:600000",
        "e2e:600000",
        "--metrics-url",
        router,
        "--metrics-url",
        prefill,
        "--metrics-url",
        decode,
        "--out",
        str(tmp_path),
        "--label",
        "pd",
        "--no-progress",
    )
    assert r.stdout.count("Successful requests:") == 2 and "P99 ITL (ms):" in r.stdout
    assert f"tokenizer: {tiny_checkpoint('llama')} (the served model's root" in r.stderr
    for rate in ("8", "inf"):
        run = json.loads((tmp_path / f"pd_rate-{rate}.json").read_text())
        s, reqs, m = run["summary"], run["requests"], run["server_metrics"]
        assert len(reqs) == s["num_requests"] == s["completed"] == 16 and s["failed"] == 0 and not s["errors"]
        for q in reqs:
            assert q["error"] is None
            assert q["output_tokens"] == q["output_len"]  # ignore_eos: exactly what was asked
            assert q["server_prompt_tokens"] == q["prompt_len"]  # exact prompt lengths, as the server counts
            assert 0 < q["ttft"] <= q["e2e"]
            assert len(q["itls"]) <= q["output_tokens"] - 1
        assert s["prompt_len_mismatches"] == 0
        assert len({q["prompt_len"] for q in reqs}) > 1  # --range-ratio varies them
        assert s["total_output_tokens"] == sum(q["output_len"] for q in reqs)
        # The servers counted the same run: every request routed and answered, every token
        # generated, and each disaggregated one prefilled once and pulled once. (The router may
        # serve a request whole when its prefill worker is slow to answer health probes on a
        # loaded machine: that is its fallback working, so the split is counted, not fixed.)
        key = 'pdserve_router_requests_total{{disaggregated="{}",route="completions",status="200"}}'
        pd = m[router].get(key.format("yes"), 0)
        assert pd + m[router].get(key.format("no"), 0) == 16 and pd > 0
        assert m[decode]["vllm:generation_tokens_total"] == s["total_output_tokens"]
        assert m[decode]["vllm:prompt_tokens_total"] == s["total_input_tokens"]
        assert m[decode]['vllm:request_success_total{finished_reason="length"}'] == 16
        assert m[prefill].get('vllm:request_success_total{finished_reason="length"}', 0) == pd
        assert m[decode].get('pdserve_kv_transfer_seconds_count{direction="recv",transport="tcp"}', 0) == pd
        assert s["request_goodput"] == pytest.approx(s["request_throughput"])  # generous SLO: all good
    assert (tmp_path / "latency_cdf.png").stat().st_size > 0 and (tmp_path / "vs_rate.png").stat().st_size > 0


def _dataset(path: Path) -> Path:
    rows = [{"prompt": "plain request"}] * 4 + [{"prompt": "MOCK_429 please"}] * 4 + [{"prompt": "MOCK_CUT me"}] * 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_errors_by_type_and_the_concurrency_cap(mock, default_model_dir, tmp_path):
    r = bench("serve", "--base-url", mock, "--model", "mock", "--tokenizer", str(default_model_dir),
              "--dataset", str(_dataset(tmp_path / "d.jsonl")), "--output-len", "20", "--num-requests", "12",
              "--concurrency", "3", "--out", str(tmp_path), "--label", "mock", "--no-progress")
    s = json.loads((tmp_path / "mock_rate-inf.json").read_text())["summary"]
    assert s["completed"] == 4 and s["failed"] == 8
    assert s["errors"] == {"http_429:rate_limit_exceeded": 4, "stream_truncated": 4}
    assert "http_429:rate_limit_exceeded:" in r.stdout
    stats = json.loads(urllib.request.urlopen(mock + "/stats").read())
    assert stats["max_in_flight"] == 3


def test_runs_on_runtime_dependencies_alone(mock, default_model_dir, tmp_path):
    """The product's install has no matplotlib: JSON is written, plots are skipped with a note."""
    # pyyaml stays: transformers requires it, so the product's install has it whatever `dev` says.
    blocked = [m for m in dev_only_packages() if m != "yaml"]
    assert "matplotlib" in blocked
    script = textwrap.dedent(f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None
        from pdserve.bench.serve import main
        sys.exit(main(["--base-url", {mock!r}, "--model", "mock", "--tokenizer", {str(default_model_dir)!r},
                       "--input-len", "16", "--output-len", "4", "--num-requests", "5", "--request-rate", "50",
                       "--out", {str(tmp_path)!r}, "--no-progress"]))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "matplotlib" in r.stderr and "pip install matplotlib" in r.stderr
    assert f"pdserve bench plot {tmp_path} --out {tmp_path}" in r.stderr  # how to get the plots of this run
    assert json.loads((tmp_path / "run_rate-50.json").read_text())["summary"]["completed"] == 5
    assert not list(tmp_path.glob("*.png"))


def test_plot_draws_two_labelled_setups(mock, default_model_dir, tmp_path, capsys):
    from pdserve.bench import plot, serve

    for label in ("a", "b"):
        assert serve.main(["--base-url", mock, "--model", "mock", "--tokenizer", str(default_model_dir),
                           "--input-len", "16", "--output-len", "4", "--num-requests", "6", "--sweep-rates", "20,40",
                           "--out", str(tmp_path / "runs"), "--label", label, "--no-progress"]) == 0
    assert len(list((tmp_path / "runs").glob("*.json"))) == 4
    r = bench("plot", str(tmp_path / "runs"), "--out", str(tmp_path / "plots"))
    assert (tmp_path / "plots" / "vs_rate.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    assert "wrote" in r.stdout
    (tmp_path / "junk.json").write_text("{}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path / "junk.json"), "--out", str(tmp_path)])
    assert e.value.code == 2 and "not a `pdserve bench serve` run" in capsys.readouterr().err


def test_multi_turn_sends_each_turn_after_the_previous_one(mock, default_model_dir):
    import asyncio

    from pdserve.bench import dataset, serve

    tok = dataset.load_tokenizer(str(default_model_dir))
    specs = dataset.multi_turn_requests(tok, 3, 3, 8, 5, seed=1)
    # All at once, then staggered (conversations at a rate, think time between turns).
    for cfg in (serve.LoadConfig(mock, "mock", progress=False),
                serve.LoadConfig(mock, "mock", progress=False, conversation_rate=200.0, think_time_s=0.005)):
        results, _ = asyncio.run(serve.run_load(cfg, specs))
        assert all(r.ok for r in results) and len(results) == 9
        for c in range(3):
            turns = [r for s, r in zip(specs, results) if s.conversation == c]
            for before, after in zip(turns, turns[1:]):
                assert after.start >= before.start + before.e2e  # sent once the previous turn ended
