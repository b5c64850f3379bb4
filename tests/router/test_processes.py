"""`pdserve router --workers 2` (router/processes.py) with real processes: both serve the one
port, their answers are the same, and the pod-wide flow-control bounds hold across them (each
process enforces half)."""

from __future__ import annotations

import threading

import httpx
import pytest

from pdserve.protocol.flags import ConfigError
from pdserve.router.config import RouterConfig
from pdserve.router.processes import per_process
from tests.router.test_failures import eventually


def process_of(response: httpx.Response) -> str:
    """The router process that answered: a generated request id starts with its process's prefix."""
    return response.headers["x-request-id"][:16]


def test_pod_wide_bounds_are_split_over_the_processes():
    config = RouterConfig(
        decode_urls=("http://w:1",),
        workers=2,
        flow_control_max_inflight=5,
        flow_control_tenant_tokens_per_minute=1000,
        max_client_connections=4096,
    )
    each = per_process(config)
    assert (each.flow_control_max_inflight, each.flow_control_tenant_tokens_per_minute) == (2, 500)
    assert each.flow_control_tenant_max_inflight == 0  # no limit stays no limit
    assert each.max_client_connections == 2048
    with pytest.raises(ConfigError) as e:
        per_process(RouterConfig(decode_urls=("http://w:1",), workers=4, flow_control_max_inflight=3))
    assert e.value.flag == "--flow-control-max-inflight"


def test_two_processes_serve_one_port_and_hold_the_pods_bounds(launch):
    worker = launch.fake_worker("--model", "tiny")
    # Pod-wide: 2 requests on workers, 2 waiting; so each process: 1 on its worker, 1 waiting.
    router = launch.router(
        "--decode",
        worker.url,
        "--workers",
        "2",
        "--flow-control-max-inflight",
        "2",
        "--flow-control-max-queue",
        "2",
        "--flow-control-queue-timeout",
        "120",
    )
    worker.control(hold="answer")
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def send() -> None:
        # A new connection each: the kernel spreads connections, not requests, over the processes.
        r = httpx.post(
            router.url + "/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": "same question", "max_tokens": 4, "temperature": 0},
        )
        with lock:
            answers.append(r)

    threads: list[threading.Thread] = []

    def refused_by() -> set[str]:
        with lock:
            return {process_of(r) for r in answers if r.status_code == 429}

    # Until both processes refuse (each has its one slot and its one queue place taken).
    for _ in range(60):
        if len(refused_by()) == 2:
            break
        t = threading.Thread(target=send, daemon=True)
        t.start()
        threads.append(t)
        t.join(timeout=0.5)  # a refusal comes back at once; a held request stays out
    eventually(lambda: len(refused_by()) == 2)
    with lock:
        assert all(
            r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
            for r in answers
            if r.status_code == 429
        )
    # The pod's bound held: two requests reached the worker, two wait, however many were sent.
    eventually(lambda: len(worker.requests()) == 2)
    assert sum(t.is_alive() for t in threads) == 4
    worker.control(release=True)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    served = [r for r in answers if r.status_code == 200]
    assert len(served) == 4 and len(worker.requests()) == 4
    assert len({process_of(r) for r in served}) == 2  # both processes served
    assert len({r.json()["choices"][0]["text"] for r in served}) == 1  # the same answer from each
