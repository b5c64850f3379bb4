"""The worker's life around requests: not ready until the engine runs, client disconnects free
KV blocks (streamed, non-streamed, and still queued), SIGTERM drains and exits 0, and bad
start-up input exits with a message."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers.metrics import metric
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

# Long enough that nothing in these tests can finish on its own: a request that stops early
# was aborted. (Decode runs ~100-300 tokens/s here, so 30000 tokens would take minutes.)
LONG = {"prompt": "Go on and on", "max_tokens": 30000, "ignore_eos": True}
LONG_ARGS = ("--max-model-len", "32768", "--kv-cache-memory", str(64 << 20))


def _wait(cond, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := cond():
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _aborts(url: str) -> float:
    return metric(url, "vllm:request_success_total", finished_reason="abort")


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    # One sequence at a time, so a second request provably waits in the queue.
    with WorkerProcess(tiny_checkpoint("llama"), *LONG_ARGS, "--max-num-seqs", "1") as w:
        yield w


def _kv(url):
    return httpx.get(f"{url}/debug/kv").json()


def test_stream_disconnect_aborts_and_frees_blocks(worker):
    start, aborts = _kv(worker.url), _aborts(worker.url)
    with httpx.stream("POST", f"{worker.url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip((x for x in lines if x.startswith("data: ")), range(3))]
        assert len(got) == 3 and _kv(worker.url)["num_running"] == 1
    _wait(lambda: _kv(worker.url)["num_free_blocks"] == start["num_free_blocks"], "blocks to return")
    assert _kv(worker.url)["num_running"] == 0 and _aborts(worker.url) == aborts + 1


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_non_stream_and_queued_disconnects_abort(worker):
    start, aborts = _kv(worker.url), _aborts(worker.url)
    running = _raw_post(worker.url, "/v1/completions", LONG)
    _wait(lambda: _kv(worker.url)["num_running"] == 1, "the first request to run")
    queued = _raw_post(worker.url, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "wait"}], "stream": True, "max_tokens": 5})
    _wait(lambda: _kv(worker.url)["num_waiting"] == 1, "the second request to queue")
    queued.close()  # before its first byte: the handler is still waiting on the engine
    _wait(lambda: _kv(worker.url)["num_waiting"] == 0, "the queued request to go")
    assert _kv(worker.url)["num_running"] == 1
    running.close()
    _wait(lambda: _kv(worker.url)["num_free_blocks"] == start["num_free_blocks"], "blocks to return")
    assert _kv(worker.url)["num_running"] == 0 and _aborts(worker.url) == aborts + 2


def test_sigterm_drains_aborts_after_grace_and_exits_zero(tiny_checkpoint):
    w = WorkerProcess(tiny_checkpoint("llama"), *LONG_ARGS, "--shutdown-grace", "1").start().wait_ready()
    try:
        events: list[str] = []

        def read():
            with httpx.stream("POST", f"{w.url}/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read)
        reader.start()
        _wait(lambda: _kv(w.url)["num_running"] == 1, "the stream to start")
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(120) == 0, w.output()
        reader.join(60)
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2].removeprefix("data: "))["choices"][0]
        assert last["finish_reason"] == "abort"
        assert "draining" in w.output()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{w.url}/health", timeout=5)
    finally:
        w.stop(signal.SIGKILL)


def test_not_ready_until_engine_loaded(tiny_checkpoint):
    """In process, on a real socket: the engine's load is held back by a gate."""
    import uvicorn

    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.async_engine import AsyncEngine
    from pdserve.worker.server.app import build_app
    from pdserve.worker.server.config import ServerConfig

    gate = threading.Event()
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu", max_model_len=64, kv_cache_memory=8 << 20)

    def factory():
        assert gate.wait(120)
        return AsyncEngine.from_config(cfg)

    port = free_port()
    app = build_app(ServerConfig(host="127.0.0.1", port=port), "gated", factory)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: server.started, "uvicorn to listen")
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{url}/debug/kv").status_code == 503
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "gated"
        assert "vllm:num_requests_running" not in httpx.get(f"{url}/metrics").text
        gate.set()
        _wait(lambda: httpx.get(f"{url}/health").status_code == 200, "the engine to load", 120)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics").text
    finally:
        gate.set()
        server.should_exit = True
        thread.join(60)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "worker", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,flag", [(("--block-size", "3"), "--block-size"), (("--port", "70000"), "--port"),
                                       (("--api-key", ""), "--api-key")])
def test_bad_flags_exit_2_naming_the_flag(args, flag):
    r = _cli(*args)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


def test_model_that_cannot_load_exits_1(tmp_path):
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"not a checkpoint")
    r = _cli("--model", str(bogus), "--port", str(free_port()), "--host", "127.0.0.1")
    assert r.returncode == 1
    assert "is a file" in r.stderr
