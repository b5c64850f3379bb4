"""Issue 23 item 3 behind the router: a worker that may decode (role both, with a KV transfer)
but was started without --kv-peer-allow pulls from no one. That deployment mistake is logged
as an error when it starts, and a P/D request it gets is served by prefilling locally (counted
in pdserve_kv_local_prefill_fallbacks_total, what an alert watches), never a 400 blaming
kv_transfer_params, a field the client never sent. (A worker started as --role decode without
peers refuses to start: tests/worker/test_exposure_defaults.py.) Streamed params, whose first
token only a pull would bring, it refuses with `kv_stream_unsupported`; the router then waits for
the prefill's answer and hands over its final params.

Real processes: a prefill worker, the `both` worker and the router, each its own OS process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.helpers.metrics import metric
from tests.net import free_port
from tests.router.conftest import ROOT, Proc, wait_http

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
SECRET = {"PDSERVE_KV_SECRET": "pd-without-peers-kv-secret-0123"}


def worker(launch, ckpt, log: Path, *args: str) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", str(ckpt), "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--kv-transfer", "tcp", "--kv-port", str(free_port()),
           "--device", "cpu", "--max-model-len", "256", "--log-level", "warning", *args]
    with open(log, "w") as out:
        popen = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **SECRET})
    proc = Proc(f"http://127.0.0.1:{port}", popen, cmd)
    launch.procs.append(proc)
    return proc


def test_a_worker_that_pulls_from_no_one_prefills_locally_and_says_so(launch, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    logs = Path(tempfile.mkdtemp(prefix="pd-without-peers-"))
    prefill = worker(launch, ckpt, logs / "prefill.log", "--role", "prefill")
    both = worker(launch, ckpt, logs / "both.log", "--role", "both")  # no --kv-peer-allow
    for w in (prefill, both):
        wait_http(w.url + "/health", w.popen, timeout_s=180)
    assert "--kv-peer-allow is empty" in (logs / "both.log").read_text()  # loud at start
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    alone = httpx.post(f"{both.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    router = launch.router("--prefill", prefill.url, "--decode", both.url)
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == alone
    assert metric(router.url, "pdserve_router_requests_total", disaggregated="yes") >= 1  # it went P then D
    assert metric(both.url, "pdserve_kv_local_prefill_fallbacks_total") == 1
    assert metric(both.url, "pdserve_kv_transfer_bytes_total") == 0  # and contacted no peer
    # Streamed too: the router's streamed hand-off is refused with kv_stream_unsupported by a
    # worker that pulls from no one, and the router hands over the final params instead.
    text = ""
    with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c.get("text", "") for c in __import__("json").loads(line[6:])["choices"])
    assert text == alone
    assert metric(both.url, "pdserve_kv_local_prefill_fallbacks_total") == 2
