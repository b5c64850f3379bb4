"""Issue 15 on the router, with real processes (router + tests/router/fake_worker.py, which
stands in for workers so faults can be injected: 4xx answers, SIGSTOP, restarts on the same
port). Bad input is a 400 and never a worker failure; the router presents its worker key;
an unkeyed client reaches only /health and /ready; a restarted worker is readmitted without
waiting out its ejection backoff; every in-flight count returns to 0 on every path; slow
clients are cut off without starving others or counting as 500s."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from tests.router.test_failures import PROMPT, eventually, metric

KEY = "sk-router-client"
WORKER_KEY = "sk-router-to-worker"


def workers_view(router, key=None) -> list[dict]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(router.url + "/debug/workers", headers=headers, timeout=5).json()


def inflight_total(router, key=None) -> int:
    return sum(w["inflight"] for w in workers_view(router, key))


BAD_BODIES = {
    "surrogate in prompt": b'{"model": "tiny", "prompt": "hi \\ud800 there"}',
    "surrogate in prompt list": b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}',
    "surrogate in stop": b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"]}',
    "surrogate in a key": b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}',
    "deep nesting": b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep unbalanced": b"[" * 100_000,
    "max_tokens as string": b'{"model": "tiny", "prompt": "hi", "max_tokens": "16"}',
    "n as string": b'{"model": "tiny", "prompt": "hi", "n": "2"}',
    "temperature as string": b'{"model": "tiny", "prompt": "hi", "temperature": "0.5"}',
    "seed as bool": b'{"model": "tiny", "prompt": "hi", "seed": true}',
    "ignore_eos as string": b'{"model": "tiny", "prompt": "hi", "ignore_eos": "true"}',
    "huge max_tokens": b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e400}',
}
BAD_CHAT = {
    "surrogate in message": b'{"model": "tiny", "messages": [{"role": "user", "content": "a \\ud800 b"}]}',
    "surrogate in content part": b'{"model": "tiny", "messages": [{"role": "user", "content": '
                                 b'[{"type": "text", "text": "\\udc00"}]}]}',
    "max_completion_tokens as string": b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                                       b'"max_completion_tokens": "5"}',
}


@pytest.fixture(scope="module")
def keyed(module_launch):
    decode = module_launch.fake_worker()
    prefill = module_launch.fake_worker()
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url, "--api-key", KEY,
                                  "--worker-api-key", WORKER_KEY, "--eject-after-failures", "1")
    return prefill, decode, router


def post(router, path, content, key=KEY):
    return httpx.post(router.url + path, content=content, timeout=30,
                      headers={"content-type": "application/json", "authorization": f"Bearer {key}"})


@pytest.mark.parametrize("path,body", [("/v1/completions", b) for b in BAD_BODIES.values()]
                         + [("/v1/chat/completions", b) for b in BAD_CHAT.values()],
                         ids=list(BAD_BODIES) + list(BAD_CHAT))
def test_bad_input_is_400_and_never_reaches_a_worker(keyed, path, body):
    prefill, decode, router = keyed
    seen = len(decode.requests()) + len(prefill.requests())
    r = post(router, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert len(decode.requests()) + len(prefill.requests()) == seen


def test_worker_4xx_passes_through_and_is_not_a_worker_failure(keyed):
    """Ejection after ONE failure: had a worker's 400 counted, the decode pool would be empty."""
    prefill, decode, router = keyed
    for _ in range(5):  # the fake worker refuses max_tokens < 0 (the router's models allow it)
        r = post(router, "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": -1}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert all(w["routable"] and w["consecutive_failures"] == 0 for w in workers_view(router, KEY))
    assert metric(router, "pdserve_router_upstream_errors_total", headers={"authorization": f"Bearer {KEY}"}) == 0
    assert httpx.get(router.url + "/ready").status_code == 200
    assert post(router, "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 3}').status_code == 200


@pytest.mark.parametrize("status", [400, 404, 413, 422, 429])
def test_every_client_error_class_passes_through_uncounted(keyed, status):
    """A worker's refusal of the request's content is the client's answer (429: after the other
    workers refused too), never a failure of the worker: with ejection after ONE failure, a
    counted one would empty the pools."""
    prefill, decode, router = keyed
    for w in (prefill, decode):
        w.control(refuse=status)
    try:
        for stream in (False, True):
            r = post(router, "/v1/chat/completions", json.dumps({
                "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": stream}).encode())
            assert r.status_code == status, r.text
            assert r.json()["error"]["type"]
    finally:
        for w in (prefill, decode):
            w.control(refuse=0)
    assert all(w["routable"] and w["consecutive_failures"] == 0 for w in workers_view(router, KEY))
    assert metric(router, "pdserve_router_upstream_errors_total", headers={"authorization": f"Bearer {KEY}"}) == 0
    assert post(router, "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 3}').status_code == 200


def test_a_request_the_engine_failed_alone_is_final_and_not_a_worker_failure(keyed):
    """A worker's 500 `request_failed` (its engine failed that request alone and serves on): the
    client gets it as it is, once, and no worker is blamed; with ejection after ONE failure, a
    counted one would empty the pools."""
    prefill, decode, router = keyed
    for w in (prefill, decode):
        w.control(mode="request_failed")
    try:
        for stream in (False, True):
            r = post(router, "/v1/chat/completions", json.dumps({
                "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": stream}).encode())
            assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
    finally:
        for w in (prefill, decode):
            w.control(mode="ok")
    assert all(w["routable"] and w["consecutive_failures"] == 0 for w in workers_view(router, KEY))
    assert metric(router, "pdserve_router_upstream_errors_total", headers={"authorization": f"Bearer {KEY}"}) == 0
    assert post(router, "/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 3}').status_code == 200


def test_every_worker_call_carries_the_worker_key(keyed):
    prefill, decode, router = keyed
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    for stream in (False, True):
        r = httpx.post(router.url + "/v1/completions", json={**body, "stream": stream}, timeout=30,
                       headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
    sent = prefill.requests()[-2:] + decode.requests()[-2:]
    assert "kv_transfer_params" in sent[-1]["body"]  # it was P/D
    assert {req["headers"].get("authorization") for req in sent} == {f"Bearer {WORKER_KEY}"}


def test_unkeyed_client_reaches_only_health_and_ready(keyed):
    _, _, router = keyed
    assert httpx.get(router.url + "/health").status_code == 200
    assert httpx.get(router.url + "/ready").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/debug/workers"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        for key in (None, "wrong", WORKER_KEY):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            r = httpx.request(method, router.url + path, headers=headers, json={"model": "tiny", "prompt": "x"})
            assert r.status_code == 401, (method, path, key, r.text)
            assert r.json()["error"]["type"] == "authentication_error"


def test_restarted_worker_is_readmitted_without_waiting_out_its_backoff(launch):
    """A 60 s backoff: only a probe that saw the worker down and then healthy can readmit it in time."""
    decode = launch.fake_worker()
    router = launch.router("--decode", decode.url, "--eject-after-failures", "1", "--eject-backoff", "60")
    decode.stop()
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert r.status_code in (502, 503)
    eventually(lambda: not workers_view(router)[0]["healthy"])  # a probe saw it down
    assert not workers_view(router)[0]["routable"]
    decode = launch.restart(decode)
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 200, timeout_s=20)
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200


def test_worker_ejected_for_errors_while_healthy_keeps_its_backoff(launch):
    decode, spare = launch.fake_worker(), launch.fake_worker()
    router = launch.router("--decode", decode.url, "--decode", spare.url, "--eject-after-failures", "1",
                           "--eject-backoff", "60", "--decode-policy", "round-robin")
    decode.control(mode="500")
    for _ in range(4):  # retried on the spare: every answer is good
        r = httpx.post(
            router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=10
        )
        assert r.status_code == 200
    view = {w["url"]: w for w in workers_view(router)}
    assert not view[decode.url]["routable"] and view[decode.url]["healthy"]
    n = len(decode.requests())
    for _ in range(10):  # probes keep saying 200, yet no request goes to the ejected worker
        assert httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                          timeout=10).status_code == 200
    assert len(decode.requests()) == n


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_sigstopped_workers_hold_nothing_after_the_client_leaves(launch, stream):
    """Every acquire released: a stopped prefill (client hangs up while it waits), then a stopped
    decode (client hangs up before its first byte); counts read back from /debug/workers."""
    prefill, decode = launch.fake_worker(), launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    for stopped in (prefill, decode):
        os.kill(stopped.popen.pid, signal.SIGSTOP)
        try:
            with pytest.raises(httpx.ReadTimeout):
                with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=1.5) as r:
                    for _ in r.iter_raw():  # streamed: the first token may arrive, then silence
                        pass
            eventually(lambda: inflight_total(router) == 0)
        finally:
            os.kill(stopped.popen.pid, signal.SIGCONT)
    eventually(lambda: all(w["routable"] for w in workers_view(router)))
    assert httpx.post(router.url + "/v1/completions", json={**body, "stream": False}, timeout=10).status_code == 200
    assert inflight_total(router) == 0


def test_sigstopped_decode_is_bounded_by_the_request_timeout(launch):
    decode = launch.fake_worker()
    router = launch.router("--decode", decode.url, "--request-timeout", "2", "--first-byte-timeout", "2",
                           "--max-retries", "0")
    os.kill(decode.popen.pid, signal.SIGSTOP)
    try:
        for stream in (False, True):
            r = httpx.post(router.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": stream})
            assert r.status_code in (502, 503) and r.json()["error"]["code"] in ("upstream_failed", "no_workers")
        assert inflight_total(router) == 0
    finally:
        os.kill(decode.popen.pid, signal.SIGCONT)


async def _slow_clients(host: str, port: int, n_headers: int, n_bodies: int, interval_s: float, lines: int):
    """Slowloris: n_headers connections send a header line, n_bodies a body line, every
    interval_s, `lines` times. Returns, per connection (header ones first), how the server
    ended it while the client was still sending: "408" (answered so), "closed" (EOF or reset,
    no answer), or "finished" (the client got to the end: the server never cut it off)."""

    async def one(slow_body: bool) -> str:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            if slow_body:
                writer.write(head + b"content-length: 100000\r\n\r\n{")
            else:
                writer.write(head)
            for i in range(lines):
                await writer.drain()
                try:
                    data = await asyncio.wait_for(reader.read(1024), interval_s)
                except asyncio.TimeoutError:
                    writer.write(b' "k": 1,' if slow_body else f"x-slow-{i}: 1\r\n".encode())
                    continue
                return "408" if data.startswith(b"HTTP/1.1 408") else "closed" if not data else data[:12].decode()
            return "finished"
        except (ConnectionError, OSError):
            return "closed"
        finally:
            writer.close()

    return await asyncio.gather(*[one(False) for _ in range(n_headers)], *[one(True) for _ in range(n_bodies)])


def slowloris_while_served(url: str, n: int) -> tuple[list[str], list[str], int]:
    """n slow-header and n slow-body clients, and meanwhile one well-behaved request, all on one
    event loop (a blocking request here would stall the slow clients' own sends, and a client
    that never got its headers out is cut by the header deadline, not the body's). Returns the
    header clients' outcomes, the body clients' and the well-behaved request's status."""
    host, port = url.removeprefix("http://").split(":")

    async def main():
        slow = asyncio.create_task(_slow_clients(host, int(port), n, n, 0.5, 20))
        await asyncio.sleep(0.3)  # they are connected and trickling
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        outcomes = await slow
        return outcomes[:n], outcomes[n:], r.status_code

    return asyncio.run(main())


def assert_cut_off(headers: list[str], bodies: list[str], n: int) -> None:
    """Every slow client was cut off before it finished: header clients closed with no answer (a
    request that never finished its headers), body clients answered 408 or closed (the header
    deadline, when the machine was too busy to get their headers out in time). The body deadline
    answers 408, it does not just hang up: at least one such answer."""
    assert headers == ["closed"] * n
    assert "finished" not in bodies and set(bodies) <= {"408", "closed"}, sorted(set(bodies))
    assert bodies.count("408") > 0


def test_slow_clients_are_cut_off_without_starving_others_or_counting_as_500(launch):
    decode = launch.fake_worker()
    # Headers get 2 s (slow ones would take 10 s): a loaded machine may take a while to send a
    # slow-body client's complete headers, and that client must reach its body deadline (1 s).
    router = launch.router("--decode", decode.url, "--header-timeout", "2", "--body-timeout", "1")
    n = 250  # 500 slow connections, as in the review
    headers, bodies, served = slowloris_while_served(router.url, n)
    assert served == 200
    assert_cut_off(headers, bodies, n)
    # Every 408 a client saw was counted before it was sent; none of this is a server error.
    assert metric(router, "pdserve_router_requests_total", status="408") == bodies.count("408")
    assert metric(router, "pdserve_router_requests_total", status="500") == 0


def _concurrently(n: int, fn) -> list:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_calls_waiting_on_a_sigstopped_worker_move_to_a_healthy_one(launch, role, stream):
    """A stopped worker accepts connections and says nothing. The router's timeouts stay at
    their defaults (minutes); once the worker fails three health probes, the calls waiting on it
    are abandoned and retried on the other worker, so every client gets its full answer well
    inside the client's 60 s. Without that, the stopped worker's share would hang for 300 s."""
    stopped, other, decode, single = (launch.fake_worker() for _ in range(4))
    pools = (("--prefill", stopped.url, "--prefill", other.url, "--decode", decode.url) if role == "prefill"
             else ("--decode", stopped.url, "--decode", other.url))
    router = launch.router(*pools, f"--{role}-policy", "round-robin")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": stream}
    want = httpx.post(single.url + "/v1/completions", json={**body, "stream": False}, timeout=10).json()
    want_text = want["choices"][0]["text"]

    def ask() -> str:
        if not stream:
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text += "".join(c["text"] for c in event["choices"])
        return text

    os.kill(stopped.popen.pid, signal.SIGSTOP)
    try:
        # Round-robin over both workers: with four at once, the stopped one holds some of them.
        assert _concurrently(4, ask) == [want_text] * 4
        lost = metric(router, "pdserve_router_upstream_errors_total", worker=stopped.url)
        assert lost >= 1  # the calls really went to the stopped worker and were moved
        if role == "prefill":  # moved to the other prefill worker, not prefilled locally
            assert all("kv_transfer_params" in r["body"] for r in decode.requests())
        eventually(lambda: inflight_total(router) == 0)
    finally:
        os.kill(stopped.popen.pid, signal.SIGCONT)


def test_a_stream_from_a_worker_that_stops_mid_answer_ends_with_an_error_event(launch):
    """Once bytes went to the client, with no other worker to move the stream to (router/migration.py),
    it ends with one error event as soon as the worker is found lost, not after the 120 s idle timeout."""
    decode = launch.fake_worker("--delay", "0.2")
    router = launch.router("--decode", decode.url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True}
    events = []
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 2:
                os.kill(decode.popen.pid, signal.SIGSTOP)
    try:
        assert events[-1]["error"]["code"] == "upstream_failed", events[-1]
        assert "WorkerLost" in events[-1]["error"]["message"] or "closed" in events[-1]["error"]["message"]
        eventually(lambda: inflight_total(router) == 0)
    finally:
        os.kill(decode.popen.pid, signal.SIGCONT)
