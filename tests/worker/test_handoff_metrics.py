"""The hand-off made visible (issue 24, item 4) on real prefill and decode worker processes:
a plain request shows one queue-time observation; a P/D request shows, on the decode worker,
one observation in each hand-off wait histogram and one pull in the per-request bytes and
bandwidth histograms under its transport, whether its KV came whole or streamed chunk by chunk,
and a streamed one its pull's tail after the prefill's end.

A worker may count a request after its client has seen the answer, so every count is read by
polling /metrics until it appears, within a bound; nothing here sleeps or asserts on timing.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers.metrics import metric_value, scrape
from tests.worker.kv_harness import PD_ARGS, leaves_no_kv, pd_pair
from tests.worker.test_server_harness import WorkerProcess

ARGS = PD_ARGS
BODY = {"prompt": "Metrics of a hand-off: the prefill worker ran this prompt, the decode worker", "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}
QUEUE = "vllm:request_queue_time_seconds_count"
ADMISSION = "pdserve_kv_decode_admission_wait_seconds_count"
FIRST_STEP = "pdserve_kv_first_step_wait_seconds_count"
TAIL = "pdserve_kv_pull_tail_seconds_count"
PULL_SERIES = ("pdserve_kv_transfer_seconds_count", "pdserve_kv_transfer_request_bytes_count",
               "pdserve_kv_transfer_bandwidth_bytes_per_second_count")


def wait_counts(w: WorkerProcess, expected: dict, timeout: float = 30) -> str:
    """Poll until every (name, labels) count in `expected` reaches its value; the last /metrics page."""
    deadline = time.monotonic() + timeout
    while True:
        snap = scrape(w.url, w.headers)
        got = {key: metric_value(snap, key[0], **dict(key[1])) for key in expected}
        if all(got[k] >= v for k, v in expected.items()) or time.monotonic() > deadline:
            assert got == expected, f"counts on {w.url}/metrics"
            return snap
        time.sleep(0.1)


def key(name: str, **labels) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(request, tiny_checkpoint):
    with pd_pair(tiny_checkpoint("llama"), request.param, ARGS, {}, pin_ttl=5, pull_timeout=5) as (p, d):
        yield request.param, p, d


def test_a_plain_request_is_one_queue_time_observation(pair):
    _, _, d = pair
    before = scrape(d.url, d.headers)
    counts = {n: metric_value(before, n) for n in (QUEUE, ADMISSION, FIRST_STEP)}
    r = httpx.post(f"{d.url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    snap = wait_counts(d, {key(QUEUE): counts[QUEUE] + 1})
    # The hand-off waits are observed before the queue time (the engine's first output, then
    # the server): a plain request added none.
    assert metric_value(snap, ADMISSION) == counts[ADMISSION] and metric_value(snap, FIRST_STEP) == counts[FIRST_STEP]


def prefill_then_decode(p: WorkerProcess, d: WorkerProcess, body: dict, streamed: bool) -> str:
    """A P/D request by hand; streamed: the decode call starts on the prefill's early params, while
    the prefill runs. Returns the transport the prefill worker named."""
    prefill = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "stream_kv": streamed}}
    if not streamed:
        first = httpx.post(f"{p.url}/v1/completions", timeout=60, json=prefill)
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        rest = httpx.post(f"{d.url}/v1/completions", timeout=60, json={**body, "kv_transfer_params": params})
        assert rest.status_code == 200, rest.text
        return params["transport"]
    with httpx.stream("POST", f"{p.url}/v1/completions", timeout=60, json=prefill) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        early = json.loads(next(lines))["kv_transfer_params"]
        decoded = {}
        t = threading.Thread(target=lambda: decoded.update(r=httpx.post(
            f"{d.url}/v1/completions", timeout=60, json={**body, "kv_transfer_params": early})))
        t.start()
        json.loads(next(lines))  # the prefill's answer
    t.join(60)
    assert not t.is_alive() and decoded["r"].status_code == 200, decoded
    return early["transport"]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_pd_request_shows_its_hand_off_on_the_decode_worker(pair, streamed):
    transport, p, d = pair
    body = {**BODY, "prompt": f"A prompt only the {transport} pair has seen ({streamed}): " + BODY["prompt"]}
    recv = {"direction": "recv", "transport": transport}
    with leaves_no_kv([p, d]):
        p_before, d_before = scrape(p.url, p.headers), scrape(d.url, d.headers)
        assert prefill_then_decode(p, d, body, streamed) == transport
        expected = {key(QUEUE): metric_value(d_before, QUEUE) + 1,
                    key(ADMISSION): metric_value(d_before, ADMISSION) + 1,
                    key(FIRST_STEP): metric_value(d_before, FIRST_STEP) + 1}
        expected |= {key(n, **recv): metric_value(d_before, n, **recv) + 1 for n in PULL_SERIES}
        # Only a streamed pull has a tail after the prefill's end (a whole one starts after it).
        expected[key(TAIL, **recv)] = metric_value(d_before, TAIL, **recv) + int(streamed)
        snap = wait_counts(d, expected)
        pulled = (metric_value(snap, "pdserve_kv_transfer_bytes_total", **recv)
                  - metric_value(d_before, "pdserve_kv_transfer_bytes_total", **recv))
        request_bytes = (metric_value(snap, "pdserve_kv_transfer_request_bytes_sum", **recv)
                         - metric_value(d_before, "pdserve_kv_transfer_request_bytes_sum", **recv))
        assert pulled > 0 and request_bytes == pulled  # the one pull's bytes (all its chunks), counted once
        fallbacks = "pdserve_kv_local_prefill_fallbacks_total"
        assert metric_value(snap, fallbacks) == metric_value(d_before, fallbacks)
        # The prefill worker's own request queued too (its hand-off waits are the decode side's).
        p_snap = wait_counts(p, {key(QUEUE): metric_value(p_before, QUEUE) + 1})
        assert metric_value(p_snap, ADMISSION) == metric_value(p_before, ADMISSION)
