"""Scale from zero (router/admission_queue.py): with `--hold-timeout`, a request that finds no
worker of its model waits for one (bounded in time and number, then 503 with Retry-After), and
the first request is answered by the first real worker to come up; the router stays ready
meanwhile, so a Service keeps sending it the requests that wake the model."""

from __future__ import annotations

import sys
import threading

import httpx
import pytest

from tests.net import free_port
from tests.router.conftest import wait_http
from tests.router.test_failures import eventually
from tests.router.test_fallback import metric

BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0}


def test_a_held_request_times_out_with_retry_after(launch):
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = launch.router("--decode", nobody, "--hold-timeout", "1", "--hold-queue", "1")
    ready = httpx.get(router.url + "/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "holding"
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
    assert r.headers["retry-after"] == "1" and "within 1s" in r.json()["error"]["message"]
    assert metric(router, "pdserve_router_held_requests_total", outcome="timeout") == 1


def test_past_the_queue_bound_a_request_is_refused_at_once(launch):
    nobody = f"http://127.0.0.1:{free_port()}"
    router = launch.router("--decode", nobody, "--hold-timeout", "60", "--hold-queue", "1")
    def held() -> None:
        try:
            httpx.post(router.url + "/v1/completions", json=BODY, timeout=90)
        except httpx.HTTPError:
            pass  # still held when the test ends and the router stops

    first = threading.Thread(target=held, daemon=True)
    first.start()
    eventually(lambda: metric(router, "pdserve_router_requests_waiting_for_workers") == 1)
    r = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 503 and "already wait" in r.json()["error"]["message"] and "retry-after" in r.headers
    assert metric(router, "pdserve_router_held_requests_total", outcome="queue_full") == 1


@pytest.mark.slow
def test_the_first_request_is_answered_by_the_first_worker(launch, tiny_checkpoint):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = launch.router("--decode", url, "--hold-timeout", "300")
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(
        httpx.post(router.url + "/v1/completions", json=BODY, timeout=400)), daemon=True)
    first.start()
    eventually(lambda: metric(router, "pdserve_router_requests_waiting_for_workers") == 1)
    # What the planner does on that signal: start a worker (here, as a process).
    cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", str(tiny_checkpoint("llama")),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    worker = launch._spawn(url, cmd)
    wait_http(url + "/health", worker.popen, timeout_s=240, log=worker.log)
    first.join(400)
    (r,) = answers
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert metric(router, "pdserve_router_held_requests_total", outcome="admitted") == 1
    assert metric(router, "pdserve_router_requests_waiting_for_workers") == 0
