"""`pdserve bench serve` after `pdserve up` (issue 23, item 10): without `--tokenizer` the
tokenizer comes from the served model's `root` (its /v1/models card) when that is a directory
here, and otherwise a missing tokenizer is said at once, not after a minute of hub retries; at
rate inf `vs_rate.png` still has its points.

The hub is a local endpoint (HF_ENDPOINT) that accepts connections and closes them unanswered,
counting them: what an unreachable hub costs is counted in attempts, not timed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from e2e.processes import ROOT
from tests.net import free_port

CLI = [sys.executable, "-m", "pdserve.cli.main", "bench", "serve"]


class DeadHub:
    """Accepts connections and closes them unanswered, counting them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._count = 0
        self._marker_port: int | None = None
        self._marker_seen = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, (_, port) = self.sock.accept()
            except OSError:  # closed
                return
            if port == self._marker_port:
                self._marker_seen.set()
            else:
                self._count += 1
            conn.close()

    @property
    def connections(self) -> int:
        """Every connection made before this call, counted: connections are accepted in the
        order they were made, so once one of ours made now is accepted, all earlier ones are."""
        marker = socket.socket()
        marker.bind(("127.0.0.1", 0))
        self._marker_port = marker.getsockname()[1]
        with marker:
            marker.connect(self.sock.getsockname())
            assert self._marker_seen.wait(30), "the hub stopped accepting"
        self._marker_seen.clear()
        return self._count

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def hub():
    h = DeadHub()
    yield h
    h.close()


def mock_server(*args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mock_sse_server", "--port", str(port),
                             "--ttft-ms", "2", "--itl-ms", "1", *args], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/stats", timeout=1).read()
            return url, proc
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "mock server did not start"
            time.sleep(0.1)


@pytest.fixture
def launch_mock():
    procs = []

    def start(*args: str) -> str:
        url, proc = mock_server(*args)
        procs.append(proc)
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def bench(hub: DeadHub, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"))  # an empty cache, a hub that never answers
    return subprocess.run([*CLI, *args, "--input-len", "16", "--output-len", "4", "--num-requests", "3",
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_tokenizer_is_the_served_model_root(hub, launch_mock, default_model_dir, tmp_path):
    url = launch_mock("--model", "tiny", "--root", str(default_model_dir))
    r = bench(hub, tmp_path, "--base-url", url + "/v1", "--model", "tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"tokenizer: {default_model_dir}" in r.stderr and "Successful requests:" in r.stdout
    assert hub.connections == 0  # on 3b536ee: the hub was asked for "tiny", with retries, then exit 2


@pytest.mark.slow
def test_no_tokenizer_anywhere_is_said_at_once(hub, launch_mock, tmp_path):
    # A root on another machine (a pod's path), a served name that is no hub model.
    url = launch_mock("--model", "pdserve-no-such-model", "--root", "/models/on/another/machine")
    r = bench(hub, tmp_path, "--base-url", url, "--model", "pdserve-no-such-model")
    assert r.returncode == 2
    assert "--tokenizer" in r.stderr and "pass --tokenizer PATH" in r.stderr
    assert "/models/on/another/machine" in r.stderr and "is not a directory on this machine" in r.stderr
    assert "hub did not answer" in r.stderr and "Traceback" not in r.stderr
    # One question (its HTTP client may retry a dropped connection at once), not transformers'
    # retries with back-off (6 connections over most of a minute on 3b536ee).
    assert hub.connections <= 2


def _run(rate, label="a", throughput=10.0) -> dict:
    ok = {"error": None, "ttft": 0.01, "itls": [0.002, 0.003], "e2e": 0.02}
    summary = {"output_throughput": throughput * 4, "ttft_s": {"p99": 0.01}, "itl_s": {"p99": 0.003},
               "request_goodput": None, "request_throughput": throughput, "goodput_slos_ms": {}}
    return {"label": label, "request_rate": rate, "requests": [ok] * 3, "summary": summary}


@pytest.mark.parametrize("rates", [[None], [2.0, 8.0, None]], ids=["inf-alone", "sweep-then-inf"])
def test_vs_rate_draws_the_runs_at_rate_inf(monkeypatch, tmp_path, rates):
    pytest.importorskip("matplotlib")
    from pdserve.bench import plot

    drawn = {}
    save = plot._save

    def keep(plt, fig, title, path):  # what each chart holds, read before it is closed
        drawn[path.name] = [([p for line in ax.get_lines() for p in line.get_xydata().tolist()],
                             [t.get_text() for t in ax.get_xticklabels()]) for ax in fig.axes]
        return save(plt, fig, title, path)

    monkeypatch.setattr(plot, "_save", keep)
    plot.plot_runs([_run(r, throughput=5.0 + i) for i, r in enumerate(rates)], tmp_path)
    panels = drawn["vs_rate.png"]
    assert len(panels) == 4
    for points, ticks in panels:
        assert len(points) == len(rates)  # on 3b536ee: the inf run was left out (blank when alone)
        assert all(abs(v) != float("inf") for p in points for v in p)
        assert ticks[-1] == "inf"
        xs = [x for x, _ in points]
        assert xs == sorted(xs) and len(set(xs)) == len(xs)  # inf to the right of every finite rate
