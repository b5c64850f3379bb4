"""The streamed hand-off (issue 24, router/handoff/streamed.py) through a real router process.

The prefill and decode workers are tests/router/fake_worker.py processes speaking the contract
of the streamed hand-off (two NDJSON lines; a side channel the decode waits on), with hooks to
hold either line, fail or break after line 1, and a log of what happened to each request
(line1, line2, abort, release, d_abort). Orderings are proved by holding a line, never by
timing; waits poll a condition with a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import socket
import uuid
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from pdserve.protocol.flags import ConfigError
from pdserve.protocol.sse import DONE
from pdserve.router.config import RouterConfig
from pdserve.router.sse import token_events
from tests.router.test_failures import eventually, metric
from tests.router.test_pd import CHAT, PROMPT, run
from tests.router.test_request_accounting import call, chunk, events, orchestrator

GAP = "pdserve_router_first_token_gap_seconds_count"


@pytest.fixture(scope="module")
def stack(module_launch):
    prefill, decode, single = (module_launch.fake_worker() for _ in range(3))
    streamed = module_launch.router("--prefill", prefill.url, "--decode", decode.url)
    after = module_launch.router("--prefill", prefill.url, "--decode", decode.url, "--pd-handoff", "after-prefill")
    return prefill, decode, single, streamed, after


@pytest.fixture(scope="module")
def tolerant(stack, module_launch):
    """A router over the same workers that never ejects them for failures injected on purpose."""
    prefill, decode, *_ = stack
    return module_launch.router("--prefill", prefill.url, "--decode", decode.url, "--eject-after-failures", "1000")


@pytest.fixture(autouse=True)
def fresh_hooks(request):
    """Every test leaves the shared fakes as it found them, even when it fails mid-way."""
    yield
    if "stack" in request.fixturenames:
        prefill, decode, *_ = request.getfixturevalue("stack")
        prefill.control(release=True, handoff="ok")
        decode.control(delay=0.005, header_delay=0)


def client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)


def events_of(proc, rid: str) -> list[str]:
    return [e["event"] for e in proc.events() if e["rid"] == rid]


def request_of(proc, rid: str) -> dict | None:
    return next((r for r in proc.requests() if r["headers"].get("x-request-id") == rid), None)


def body(chat: bool, stream: bool, **kw) -> tuple[str, dict]:
    if chat:
        return "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 6, "stream": stream, **kw}
    return "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "stream": stream, **kw}


def send(router, path: str, payload: dict, rid: str) -> httpx.Response:
    r = httpx.post(router.url + path, json=payload, headers={"x-request-id": rid}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def text_of(response: httpx.Response, stream: bool) -> str:
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    out = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                out += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return out


def hang_up(router, path: str, payload: dict, rid: str, when) -> None:
    """Send a request on a raw connection and close it (the client leaves) once `when()` holds."""
    data = json.dumps(payload).encode()
    url = urlsplit(router.url)
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                  f"X-Request-Id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        eventually(when)


def settled(router, *workers) -> bool:
    """Nothing left in flight on the router, nothing pinned on any worker."""
    return metric(router, "pdserve_router_inflight") == 0 and all(w.kv()["num_pinned_blocks"] == 0 for w in workers)


# ---- answers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_streamed_answer_equals_after_prefill_and_one_worker(stack, chat, stream):
    prefill, decode, single, streamed, after = stack
    n_prefill, n_decode = len(prefill.requests()), len(decode.requests())
    got = run(client(streamed), chat, stream)
    assert got == run(client(after), chat, stream) == run(client(single), chat, stream)
    assert got[0] and got[2]["completion_tokens"] == 6
    (p_streamed, p_after) = prefill.requests()[n_prefill:]
    (d_streamed, d_after) = decode.requests()[n_decode:]
    assert p_streamed["body"]["kv_transfer_params"]["stream_kv"] is True
    assert "stream_kv" not in p_after["body"]["kv_transfer_params"]
    # Streamed: the decode worker got line 1's params (no first token yet), and both lines went out.
    rid = p_streamed["headers"]["x-request-id"]
    assert d_streamed["headers"]["x-request-id"] == rid
    assert d_streamed["body"]["kv_transfer_params"] == {"remote_url": prefill.url, "request_id": rid,
                                                        "stream_kv": True, "first": None}
    assert events_of(prefill, rid)[:1] == ["line1"] and "line2" in events_of(prefill, rid)
    # After-prefill: the decode worker got the answer's params, first token included.
    assert d_after["body"]["kv_transfer_params"]["first"] and "prefill_state_at_arrival" not in d_after
    eventually(lambda: settled(streamed, prefill) and settled(after, prefill))


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_decode_is_opened_before_the_prefill_ends(stack, stream):
    prefill, decode, single, streamed, _ = stack
    prefill.control(hold="line2")
    rid = uuid.uuid4().hex
    path, payload = body(True, stream)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send, streamed, path, payload, rid)
        # Line 2 cannot have gone out: the decode worker has the request all the same.
        eventually(lambda: request_of(decode, rid) is not None)
        assert request_of(decode, rid)["prefill_state_at_arrival"] == "running"
        assert events_of(prefill, rid) == ["line1", "progress"]
        assert not answer.done()
        prefill.control(release=True)
        got = text_of(answer.result(timeout=30), stream)
    assert events_of(prefill, rid)[-2:] == ["line2", "release"]  # the decode pulled, then released
    assert got == text_of(send(single, path, payload, uuid.uuid4().hex), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_first_token_that_ends_the_request_closes_the_decode_call(stack, stream):
    prefill, decode, single, streamed, _ = stack
    prefill.control(hold="line2")  # until the decode worker has the request
    rid = uuid.uuid4().hex
    path, payload = "/v1/completions", {"model": "tiny", "prompt": "STOP1 now", "max_tokens": 5, "stream": stream}
    got = send_released_at_the_decode(streamed, prefill, decode, path, payload, rid)
    want = send(single, path, payload, uuid.uuid4().hex)
    assert text_of(got, stream) == text_of(want, stream)
    finish = (
        got.json()["choices"][0]["finish_reason"]
        if not stream
        else [
            json.loads(e[6:])["choices"][0]["finish_reason"] for e in got.text.splitlines() if e.startswith("data: {")
        ][-1]
    )
    assert finish == "stop"
    eventually(lambda: "d_abort" in events_of(decode, rid))  # closed: the decode worker aborted
    eventually(lambda: settled(streamed, prefill))


def send_released_at_the_decode(router, prefill, decode, path: str, payload: dict, rid: str) -> httpx.Response:
    """`send` through `router` while `prefill` holds the hand-off's line 2 (hold="line2"), which
    it lets go once `decode` has the request. -> the answer."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(send, router, path, payload, rid)
        eventually(lambda: request_of(decode, rid) is not None)
        prefill.control(release=True)
        return answer.result(timeout=30)


@pytest.mark.parametrize("failure", ["error", "break"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_prefill_failing_after_line_1_falls_back_to_local_prefill(stack, tolerant, stream, failure):
    prefill, decode, single, _, _ = stack
    streamed = tolerant
    prefill.control(handoff=failure, hold="line2")  # fails once the decode worker has the request
    local = metric(streamed, "pdserve_router_retries_total", phase="prefill-local")
    rid = uuid.uuid4().hex
    path, payload = body(False, stream)
    got = send_released_at_the_decode(streamed, prefill, decode, path, payload, rid)
    assert text_of(got, stream) == text_of(send(single, path, payload, uuid.uuid4().hex), stream)
    assert failure in events_of(prefill, rid)
    handed, fallback = [r for r in decode.requests() if r["headers"].get("x-request-id") == rid]
    assert handed["body"]["kv_transfer_params"]["stream_kv"] is True
    assert "kv_transfer_params" not in fallback["body"]  # the client's request, prefilled locally
    assert metric(streamed, "pdserve_router_retries_total", phase="prefill-local") == local + 1
    eventually(lambda: "d_abort" in events_of(decode, rid))
    eventually(lambda: settled(streamed, prefill))


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_prefill_refusing_the_request_after_line_1_is_not_a_worker_failure(stack, stream):
    """Line 2 an error of a client error's type (issue 44): the decode worker answers the request
    itself, and the prefill worker is not counted as failing (three such in a row would eject it)."""
    prefill, decode, single, streamed, _ = stack
    path, payload = body(True, stream)
    send(streamed, path, payload, uuid.uuid4().hex)  # a success: the prefill worker's count is 0
    for _ in range(3):
        prefill.control(handoff="refuse", hold="line2")
        rid = uuid.uuid4().hex
        got = send_released_at_the_decode(streamed, prefill, decode, path, payload, rid)
        assert text_of(got, stream) == text_of(send(single, path, payload, uuid.uuid4().hex), stream)
        assert "refuse" in events_of(prefill, rid)
    (p,) = [w for w in httpx.get(streamed.url + "/debug/workers", timeout=5).json() if w["url"] == prefill.url]
    assert p["consecutive_failures"] == 0 and p["routable"]
    eventually(lambda: settled(streamed, prefill))


def test_a_prefill_that_answers_json_takes_the_after_prefill_path(launch):
    prefill, decode, single = launch.fake_worker("--json-prefill"), launch.fake_worker(), launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    for chat in (False, True):
        for stream in (False, True):
            assert run(client(router), chat, stream) == run(client(single), chat, stream)
    assert all(r["body"]["kv_transfer_params"]["stream_kv"] for r in prefill.requests())
    # Each decode call came after its prefill's answer, with that answer's params.
    assert all(r["body"]["kv_transfer_params"]["first"] for r in decode.requests())
    assert prefill.events() and all(e["event"] == "release" for e in prefill.events())
    eventually(lambda: settled(router, prefill))


# ---- hang-ups ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_gone_before_line_1_aborts_the_prefill(stack, stream):
    prefill, decode, _, streamed, _ = stack
    prefill.control(hold="line1")
    rid = uuid.uuid4().hex
    hang_up(streamed, *body(False, stream), rid, lambda: request_of(prefill, rid) is not None)
    # The prefill call outlives the client by the grace period, then is closed: the worker aborts.
    eventually(lambda: events_of(prefill, rid) == ["abort"])
    eventually(lambda: settled(streamed, prefill))
    assert request_of(decode, rid) is None


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_gone_between_the_lines_aborts_both(stack, stream):
    prefill, decode, _, streamed, _ = stack
    prefill.control(hold="line2")
    rid = uuid.uuid4().hex
    hang_up(streamed, *body(True, stream), rid, lambda: request_of(decode, rid) is not None)
    eventually(lambda: "abort" in events_of(prefill, rid))  # closing P's call aborted the prefill
    eventually(lambda: "d_abort" in events_of(decode, rid))  # closing D's call aborted the decode
    assert "line2" not in events_of(prefill, rid)
    eventually(lambda: settled(streamed, prefill))


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_gone_during_decode_aborts_the_decode(stack, stream):
    prefill, decode, _, streamed, _ = stack
    # A slow decode: tokens 0.2 s apart (stream), or its answer 30 s after the pull (unary).
    decode.control(**({"delay": 0.2} if stream else {"header_delay": 30}))
    rid = uuid.uuid4().hex
    path, payload = body(False, stream, max_tokens=200)
    hang_up(streamed, path, payload, rid, lambda: "release" in events_of(prefill, rid))  # the decode pulled
    eventually(lambda: "d_abort" in events_of(decode, rid))
    assert "line2" in events_of(prefill, rid) and "abort" not in events_of(prefill, rid)
    eventually(lambda: settled(streamed, prefill))


# ---- the first-token gap --------------------------------------------------------------------

def test_first_token_gap_is_observed_for_streams_of_two_tokens_or_more(stack):
    prefill, _, _, streamed, after = stack
    for router, label in ((streamed, "yes"), (after, "yes")):
        before = metric(router, GAP, disaggregated=label)
        for chat in (False, True):
            run(client(router), chat, stream=True)
        run(client(router), False, stream=False)  # not a stream
        send(router, "/v1/completions", {"model": "tiny", "prompt": "STOP1 now", "max_tokens": 5, "stream": True},
             uuid.uuid4().hex)  # one token
        assert metric(router, GAP, disaggregated=label) == before + 2
    before = metric(streamed, GAP, disaggregated="no")
    send(streamed, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2, "stream": True},
         uuid.uuid4().hex)  # two sequences: not disaggregated
    assert metric(streamed, GAP, disaggregated="no") == before + 1


def gap_count(o) -> float:
    return o.metrics.registry.get_sample_value(GAP, {"disaggregated": "no"}) or 0.0


def test_the_gap_is_observed_before_the_second_token_goes_to_the_transport():
    """As the request counter (test_request_accounting.py): a scrape made as soon as a client
    has the second token includes its gap."""
    o = orchestrator()
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    gaps = []

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            gaps.append(gap_count(o))

    async def receive():
        await asyncio.Event().wait()  # the client stays

    response = o.stream_response(call(), events([role, chunk("a"), chunk("b"), chunk("c", "length") + DONE]))
    asyncio.run(response({"type": "http", "method": "POST", "path": "/", "headers": []}, receive, send))
    assert gaps == [0, 0, 1, 1]  # the role chunk and the first token: no gap yet; then once
    assert gap_count(o) == 1


@pytest.mark.parametrize("block, n", [
    (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n', 0),
    (b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n', 0),
    (b'data: {"choices": [], "usage": {"prompt_tokens": 1}}\n\n', 0),
    (b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n', 0),
    (b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n', 0),
    (b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n', 1),
    (b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}\n\n', 1),
    (b'data: {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["\\u00e9"]}}]}\n\n', 1),
    (b'data: {"choices": [{"index": 0, "text": "a"}]}\n\ndata: {"choices": [{"index": 0, "text": "b"}]}\n\n'
     b'data: {"choices": [{"index": 0, "text": "c"}]}\n\n', 2),
])
def test_token_events(block, n):
    assert token_events(block) == n


def test_pd_handoff_flag():
    from pdserve.router.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--decode", "http://d:8000"]
    assert config_from_args(parser.parse_args(base), {}).pd_handoff == "streamed"
    assert (
        config_from_args(parser.parse_args(base + ["--pd-handoff", "after-prefill"]), {}).pd_handoff == "after-prefill"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--pd-handoff", "eventually"])
    with pytest.raises(ConfigError, match="--pd-handoff"):
        RouterConfig(decode_urls=("http://d:8000",), pd_handoff="eventually")
