"""Failure paths of the request path, each with real processes made to fail.

The workers are tests/router/fake_worker.py processes: they stand in for the worker only so
that faults can be injected on demand (500s, dying mid-request or mid-stream, hanging, holding
KV blocks until the client goes away). Waits poll with a deadline; nothing asserts a duration.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.helpers.metrics import metric

PROMPT = "a prompt long enough to be worth disaggregating"


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


def complete(router, stream=False, **kw) -> str:
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, **kw}
    if stream:
        return "".join(c.choices[0].text for c in client(router).completions.create(stream=True, **kw) if c.choices)
    return client(router).completions.create(**kw).choices[0].text


def eventually(check, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.05)


def sse_events(router, body: dict) -> list[bytes]:
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    return [e for e in raw.split(b"\n\n") if e]


def test_prefill_500_retries_another_and_failing_worker_is_ejected(launch):
    bad, good, decode, single = (launch.fake_worker() for _ in range(4))
    bad.control(mode="500")
    router = launch.router("--prefill", bad.url, "--prefill", good.url, "--decode", decode.url,
                           "--prefill-policy", "round-robin", "--eject-after-failures", "3", "--eject-backoff", "60")
    want = complete(single)
    for _ in range(8):
        assert complete(router) == want
    # Ejected after its third failure; the 60 s backoff keeps it out for the rest of the test.
    assert len(bad.requests()) == 3
    assert metric(router, "pdserve_router_retries_total", phase="prefill") == 3
    assert metric(router, "pdserve_router_upstream_errors_total", worker=bad.url, phase="prefill") == 3
    assert all("kv_transfer_params" in r["body"] for r in decode.requests())


def test_prefill_dying_mid_request_retries_another(launch):
    dying, good, decode, single = (launch.fake_worker() for _ in range(4))
    router = launch.router("--prefill", dying.url, "--prefill", good.url, "--decode", decode.url)
    dying.control(mode="exit_now")
    want = complete(single)
    assert [complete(router, stream=s) for s in (False, True, False)] == [want] * 3
    assert dying.popen.wait(10) != 0


def test_every_prefill_failing_falls_back_to_local_prefill(launch):
    p1, p2, decode, single = (launch.fake_worker() for _ in range(4))
    p1.control(mode="500")
    p2.control(mode="500")
    router = launch.router("--prefill", p1.url, "--prefill", p2.url, "--decode", decode.url)
    assert complete(router, stream=True) == complete(single, stream=True)
    assert "kv_transfer_params" not in decode.requests()[-1]["body"]
    assert metric(router, "pdserve_router_retries_total", phase="prefill-local") == 1


def test_no_healthy_prefill_goes_straight_to_decode(launch):
    prefill, decode, single = (launch.fake_worker() for _ in range(3))
    prefill.stop()  # nothing listens there any more: probes fail, the router stops trying it
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    eventually(lambda: httpx.get(router.url + "/ready").json()["prefill_workers"] == 0)
    assert complete(router) == complete(single)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_decode_failure_before_first_byte_moves_to_another(launch, stream):
    prefill, bad, good, single = (launch.fake_worker() for _ in range(4))
    bad.control(mode="500")
    router = launch.router("--prefill", prefill.url, "--decode", bad.url, "--decode", good.url,
                           "--decode-policy", "round-robin")
    want = complete(single, stream=stream)
    for _ in range(3):
        assert complete(router, stream=stream) == want
    assert bad.requests() and metric(router, "pdserve_router_retries_total", phase="decode") >= 1
    eventually(lambda: prefill.kv()["num_pinned_blocks"] == 0)


def _both_decode_workers_dying(launch, moves: int):
    """A stream on two decode workers that each die after two tokens, `moves` migrations allowed:
    -> (router, prefill worker, the stream's events, its error object)."""
    prefill, decode, other = launch.fake_worker(), launch.fake_worker(), launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url, "--decode", other.url,
                           "--max-migrations", str(moves))
    for worker in (decode, other):
        worker.control(mode="die_mid_stream", after=2)
    events = sse_events(router, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert events[-1] == b"data: [DONE]"
    return router, prefill, events, json.loads(events[-2].removeprefix(b"data: "))["error"]


def test_decode_dying_mid_stream_ends_with_one_error_event_and_done(launch):
    # Two decode workers, each dying after two tokens: the second request meets a live one however
    # soon the prober notices the first is gone (with one, a noticed death would send the second
    # request whole to the prefill worker, router/fallback.py, and it would succeed).
    # --max-migrations 0: a stream that may not move (router/migration.py; moving: test_migration.py).
    router, _, events, error = _both_decode_workers_dying(launch, 0)
    assert error["code"] == "upstream_failed" and set(error) == {"message", "type", "param", "code"}
    tokens = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]]
    assert len(tokens) == 3  # the spliced first token, then the two the worker sent before dying
    with pytest.raises(openai.APIError):
        complete(router, stream=True)  # the openai client surfaces the error event


def test_a_stream_whose_move_dies_too_ends_with_the_error_event_after_max_migrations(launch):
    router, prefill, _, error = _both_decode_workers_dying(launch, 1)
    assert error["code"] == "upstream_failed"
    assert metric(router, "pdserve_router_migrations_total", cause="lost") == 1
    eventually(lambda: prefill.kv()["num_pinned_blocks"] == 0)


def test_a_stalled_stream_moves_and_the_stalled_worker_frees_it(launch):
    # One decode worker, stalling: the continuation goes to the prefill worker (aggregated fallback).
    prefill, decode = launch.fake_worker(), launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url, "--stream-idle-timeout", "1")
    decode.control(mode="hang", after=1)
    events = sse_events(router, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert events[-1] == b"data: [DONE]" and b'"error"' not in b"".join(events)
    assert metric(router, "pdserve_router_migrations_total", cause="stalled") == 1
    assert [r for r in prefill.requests() if "continuation" in r["body"]]
    # The stalled call was closed: the worker's stream ended, its blocks back.
    eventually(lambda: decode.kv()["num_free_blocks"] == decode.kv()["num_total_blocks"])


def test_a_stream_with_no_decode_worker_left_moves_to_a_prefill_worker(launch):
    prefill, decode = launch.fake_worker(), launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    decode.control(mode="die_mid_stream", after=2)
    events = sse_events(router, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert events[-1] == b"data: [DONE]" and b'"error"' not in b"".join(events)
    assert metric(router, "pdserve_router_migrations_total", cause="lost") == 1
    moved = [r for r in prefill.requests() if "continuation" in r["body"]]
    assert len(moved) == 1 and moved[0]["headers"].get("x-pdserve-token-ids") == "1", prefill.requests()


def test_stalled_decode_stream_times_out_with_error_event(launch):
    prefill, decode = launch.fake_worker(), launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url, "--stream-idle-timeout", "1",
                           "--max-migrations", "0")
    decode.control(mode="hang", after=1)
    events = sse_events(router, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2]


def test_slow_first_byte_is_not_an_idle_stream(launch):
    # Headers after 2 s (a long local prefill) exceed the 1 s idle timeout but not the first-byte one.
    decode = launch.fake_worker("--header-delay", "2")
    router = launch.router("--decode", decode.url, "--stream-idle-timeout", "1", "--first-byte-timeout", "20")
    events = sse_events(router, {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events)


def test_first_byte_timeout_bounds_a_silent_worker(launch):
    decode = launch.fake_worker("--header-delay", "30")
    router = launch.router("--decode", decode.url, "--first-byte-timeout", "1", "--max-retries", "0")
    r = httpx.post(router.url + "/v1/completions", timeout=20,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed"


def test_dead_decode_worker_is_reprobed_and_readmitted(launch):
    decode = launch.fake_worker()
    router = launch.router("--decode", decode.url, "--eject-after-failures", "1", "--eject-backoff", "0.2")
    assert httpx.get(router.url + "/ready").status_code == 200
    decode.stop()
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert r.status_code in (502, 503) and "error" in r.json()
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 503)
    launch.restart(decode)
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 200)
    assert complete(router)


def test_one_slow_probe_is_not_a_down_worker():
    """A timed-out probe changes nothing until the next one times out too; a refused connection or
    a non-200 /health (ok=False without timed_out) takes the worker out at once."""
    from pdserve.router.workers import UNROUTABLE_AFTER_SLOW_PROBES, WorkerSet, WorkerSpec

    ws = WorkerSet(3, 1.0, 30.0)
    ws.update([WorkerSpec("http://d:1", "decode")])
    (w,) = ws.all()
    ws.probe_result(w, True)
    for _ in range(2):  # a good probe in between starts the count again
        for _ in range(UNROUTABLE_AFTER_SLOW_PROBES - 1):
            ws.probe_result(w, False, timed_out=True)
            assert w.routable()
        ws.probe_result(w, True)
    for _ in range(UNROUTABLE_AFTER_SLOW_PROBES):
        ws.probe_result(w, False, timed_out=True)
    assert not w.routable()
    ws.probe_result(w, True)
    assert w.routable()
    ws.probe_result(w, False)
    assert not w.routable()


def test_a_worker_leaving_and_rejoining_its_pool_is_logged_with_the_cause(caplog):
    """The prober, in process, against a real HTTP server whose /health turns 503 and back."""
    import asyncio
    import logging

    import aiohttp
    from aiohttp import web

    from pdserve.router.prober import Prober
    from pdserve.router.workers import WorkerSet, WorkerSpec

    async def main() -> None:
        state = {"status": 200}

        async def health(request):
            return web.Response(status=state["status"])

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        ws = WorkerSet(3, 1.0, 30.0)
        ws.update([WorkerSpec(f"http://127.0.0.1:{port}", "decode")])
        (w,) = ws.all()
        try:
            async with aiohttp.ClientSession() as session:
                prober = Prober(ws, session, 0.1, 5.0)
                for status in (200, 503, 200):
                    state["status"] = status
                    assert await prober.probe(w) == (status == 200)
                    assert w.routable() == (status == 200)
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        asyncio.run(main())
    assert "decode worker http://127.0.0.1:" in caplog.text
    assert "out of its pools: /health answered 503" in caplog.text and "back in its pools" in caplog.text


def test_a_worker_slow_to_answer_one_probe_keeps_serving(launch):
    """In full CI runs a loaded machine made one probe of every worker time out at once, and the
    router answered 503 to every request until the next probe. One slow /health now keeps the
    worker routable (watched throughout, and a request served meanwhile); a worker whose /health
    keeps timing out still leaves the pool."""
    decode = launch.fake_worker()
    # The default 2 s probe timeout: only the probe made slow on purpose (4 s) times out, not an
    # ordinary one on a loaded machine (two in a row would rightly take the worker out).
    router = launch.router("--decode", decode.url)
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 200)
    httpx.post(decode.url + "/control", json={"slow_health": 1, "health_delay": 4.0}).raise_for_status()
    routable: list[bool] = []
    deadline = time.monotonic() + 30
    while httpx.get(decode.url + "/debug/health").json()["slow_answered"] < 1:  # the slow probe is over
        assert time.monotonic() < deadline, "the slow /health was never asked for"
        routable += [w["routable"] for w in httpx.get(router.url + "/debug/workers").json()]
        time.sleep(0.01)
    assert routable and all(routable)
    assert complete(router)
    httpx.post(decode.url + "/control", json={"slow_health": 10**6}).raise_for_status()  # every probe slow
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 503, timeout_s=30)


def test_the_router_is_not_ready_until_it_knows_what_its_workers_serve(launch):
    """A worker is in its pool from discovery (or the command line) on, but until the router has
    read its /v1/models every request gets 503 "no worker is ready yet". /ready said "ready"
    meanwhile, so a full CI run's first request after /ready got that 503. /ready now waits for
    the models too."""
    decode = launch.fake_worker("--models-status", "503")
    router = launch.router("--decode", decode.url)
    # Probed (healthy, routable) and its models asked for twice: known to be unknown.
    eventually(lambda: httpx.get(decode.url + "/debug/health").json()["models_asked"] >= 2)
    assert all(w["routable"] for w in httpx.get(router.url + "/debug/workers").json())
    r = httpx.get(router.url + "/ready")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 503
    httpx.post(decode.url + "/control", json={"models_status": 200}).raise_for_status()
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 200)
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_client_disconnect_frees_blocks_on_both_workers(launch):
    prefill = launch.fake_worker("--pin-ttl", "600")  # only a release can free its blocks in time
    decode = launch.fake_worker("--delay", "0.2")
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    total = decode.kv()["num_total_blocks"]
    body = {"model": "tiny", "prompt": PROMPT * 4, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        seen = b""
        for data in r.iter_raw():
            seen += data
            if seen.count(b"data: ") >= 3:  # decode is streaming: its blocks are in use
                busy = decode.kv()["num_free_blocks"]
                break
    assert busy < total
    # Leaving the block closed the connection mid-stream.
    eventually(lambda: decode.kv()["num_free_blocks"] == total)
    eventually(lambda: prefill.kv()["num_pinned_blocks"] == 0)
    eventually(lambda: metric(router, "pdserve_router_inflight") == 0)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_gone_during_handoff_releases_every_worker(launch, stream):
    # The decode worker sends its headers only after 3 s (a slow KV pull): the client has the
    # first token (streamed) or nothing yet (unary) and hangs up in that gap.
    prefill = launch.fake_worker("--pin-ttl", "600")
    decode = launch.fake_worker("--header-delay", "3")
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "stream": stream}
    if stream:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
            first = next(r.iter_raw())
            assert b'"text"' in first  # the spliced first token, sent before the decode answered
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=body, timeout=1.5)
    eventually(lambda: decode.requests() and metric(router, "pdserve_router_inflight", worker=decode.url) == 0)
    # The decode worker did receive the handoff: what was held on it is released, not leaked.
    assert "kv_transfer_params" in decode.requests()[-1]["body"]
    assert metric(router, "pdserve_router_inflight") == 0
